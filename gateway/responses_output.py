"""A ``/v1/responses`` answer's output items and stream events, built from chat pieces.

Shapes from OpenAI's API reference ("Responses" > "The response object", "Streaming events") as
the ``openai`` SDK's types spell them (``openai.types.responses``): output items ``reasoning``
(``content: [{"type": "reasoning_text", "text"}]``, ``summary: []``), ``message`` (one
``output_text`` part: ``text``, ``annotations: []``, ``logprobs``: ``[]``, or with ``include:
["message.output_text.logprobs"]`` one ``{"token", "bytes", "logprob", "top_logprobs": [{"token",
"bytes", "logprob"}]}`` per token of the text, ``ResponseOutputText.Logprob``) and ``function_call``
(``call_id``, ``name``, ``arguments`` the JSON text, ``id`` an item id of its own). Per item the
stream says ``response.output_item.added`` (status ``in_progress``, nothing in it yet), then for
text ``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.content_part.done`` (reasoning: ``response.reasoning_text.delta`` / ``.done``), for a
call ``response.function_call_arguments.delta`` ... ``.done``, then ``response.output_item.done``
with the whole item; ``response.output_text.delta`` and ``.done`` carry their tokens' logprobs as
``{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}`` (``ResponseTextDeltaEvent.Logprob``).
:class:`OutputItems` is fed the same pieces for a whole answer as for a stream
(:mod:`gateway.translation`), so the items a stream ends with are the answer's.
"""

from __future__ import annotations

from gateway.responses import new_id
from gateway.translation import Piece

__all__ = ["OutputItems", "response_usage"]

_KINDS = {"reasoning": "reasoning", "text": "message"}


class OutputItems:
    """The output items of one response as pieces arrive: :meth:`feed` a piece, :meth:`close` at
    the end; :attr:`items` the items so far, :meth:`take` the stream events made since the last call
    (without ``sequence_number``, which the stream numbers).

    The message item stays open until the end: text that comes after a call (the chat answer's
    content is all its text, wherever it stood) goes to it, so a stream's items are the answer's.
    A reasoning item ends where anything else starts; a call where the next call starts."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._message: dict | None = None  # the open message item
        self._other: dict | None = None  # the open reasoning or function_call item
        self._events: list[dict] = []

    def take(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def feed(self, piece: Piece) -> None:
        other = self._other
        if piece.kind == "arguments":
            if other is not None and other["type"] == "function_call":  # (the chat path sends none without a call)
                other["arguments"] += piece.text
                self._event("response.function_call_arguments.delta", other, delta=piece.text)
            return
        if piece.kind == "call":
            self._end(other, "completed")
            self._other = self._start({"id": new_id("fc", "_"), "type": "function_call", "status": "in_progress",
                                       "call_id": piece.call_id, "name": piece.name, "arguments": ""})
            return
        if piece.kind == "text":
            if not piece.text and self._message is None:
                return  # (logprobs of a token that wrote nothing, with no text before: the answer has none)
            if other is not None and other["type"] == "reasoning":
                self._end(other, "completed")
                self._other = None
            if self._message is None:
                self._message = self._start_text("output_text", "msg", {"type": "message", "role": "assistant"})
            item, delta = self._message, "response.output_text.delta"
        else:
            if other is None or other["type"] != "reasoning":
                self._end(other, "completed")
                self._other = other = self._start_text("reasoning_text", "rs", {"type": "reasoning", "summary": []})
            item, delta = other, "response.reasoning_text.delta"
        part = item["content"][0]
        part["text"] += piece.text
        logprobs = {}
        if item is self._message:
            part["logprobs"] = part["logprobs"] + [_part_entry(e) for e in piece.logprobs]  # (a new list: snapshots)
            logprobs = {"logprobs": [_event_entry(e) for e in piece.logprobs]}
        self._event(delta, item, content_index=0, delta=piece.text, **logprobs)

    def close(self, status: str = "completed") -> None:
        """End the open items with ``status`` (``"incomplete"``: the response was cut short)."""
        for item in sorted((i for i in (self._message, self._other) if i is not None), key=self.items.index):
            self._end(item, status)
        self._message = self._other = None

    def _end(self, item: dict | None, status: str) -> None:
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", item, arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._event("response.output_text.done", item, content_index=0, text=part["text"],
                            logprobs=[_event_entry(e) for e in part["logprobs"]])
            else:
                self._event("response.reasoning_text.done", item, content_index=0, text=part["text"])
            self._event("response.content_part.done", item, content_index=0, part=dict(part))
        self._event("response.output_item.done", item, whole=True)

    def _start_text(self, part_type: str, prefix: str, fields: dict) -> dict:
        part = {"type": part_type, "text": "", **({"annotations": [], "logprobs": []} if prefix == "msg" else {})}
        item = self._start({"id": new_id(prefix, "_"), "status": "in_progress", **fields, "content": []})
        self._event("response.content_part.added", item, content_index=0, part=dict(part))
        item["content"].append(part)
        return item

    def _start(self, item: dict) -> dict:
        self.items.append(item)
        self._event("response.output_item.added", item, whole=True, snapshot=True)
        return item

    def _event(self, kind: str, item: dict, whole: bool = False, snapshot: bool = False, **fields) -> None:
        """One event about ``item``: its ``output_index``, and ``item_id`` or (``whole``) the item
        itself, as it is now (``snapshot``: a copy, since it will grow)."""
        event = {"type": kind, "output_index": self.items.index(item)}
        if whole:
            event["item"] = _copy(item) if snapshot else item
        else:
            event["item_id"] = item["id"]
        event.update(fields)
        self._events.append(event)


def _part_entry(entry: dict) -> dict:
    """A chat logprobs entry as an ``output_text`` part's (the same keys: token, bytes, logprob, top_logprobs)."""
    return {"token": entry["token"], "bytes": entry["bytes"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]}
                             for t in entry["top_logprobs"]]}


def _event_entry(entry: dict) -> dict:
    """A logprobs entry as a text delta / done event's (no bytes: ``ResponseTextDeltaEvent.Logprob``)."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]}


def _copy(item: dict) -> dict:
    return {**item, **({"content": [dict(p) for p in item["content"]]} if "content" in item else {})}


def response_usage(usage: dict | None) -> dict | None:
    """A chat ``usage`` as the Responses API's (``input_tokens``, ``output_tokens``,
    ``total_tokens`` and their details); None stays None (a prompt's length unknown)."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}
