"""A ``/v1/messages`` answer's content blocks and stream events, built from chat pieces.

Shapes from Anthropic's API reference ("Messages" > "Create a Message", and "Streaming Messages")
as the ``anthropic`` SDK's types spell them (``anthropic.types``): blocks ``thinking``
(``thinking``, ``signature: ""`` -- slotserve signs nothing), ``text`` and ``tool_use`` (``id``,
``name``, ``input`` the arguments as an object). A stream says, per block,
``content_block_start`` (the block, empty), ``content_block_delta`` (``thinking_delta``,
``text_delta`` or ``input_json_delta`` with ``partial_json``, the arguments' text as the model
wrote it) and ``content_block_stop``; blocks follow one another, each stopped before the next
starts. :class:`ContentBlocks` is fed the same pieces for a whole answer as for a stream
(:mod:`gateway.translation`).

A call's arguments cut by ``max_tokens`` are no JSON object: the whole answer's ``input`` is then
``{}``, while the stream sent the cut text (as Anthropic's own stream would).
"""

from __future__ import annotations

from gateway.translation import Piece, call_input

__all__ = ["ContentBlocks", "stop_reason"]

_BLOCKS = {"thinking": ("thinking", "thinking_delta"), "text": ("text", "text_delta")}
_KINDS = {"reasoning": "thinking", "text": "text"}


class ContentBlocks:
    """The content blocks of one message as pieces arrive: :meth:`feed` a piece, :meth:`close` at
    the end; :attr:`blocks` the blocks (tool inputs parsed at their block's end), :meth:`take` the
    stream events made since the last call, as ``(event type, data)``."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open = False  # whether the last block is still being written
        self._args = ""  # the open tool_use block's arguments so far
        self._events: list[tuple[str, dict]] = []

    def take(self) -> list[tuple[str, dict]]:
        events, self._events = self._events, []
        return events

    def feed(self, piece: Piece) -> None:
        open_ = self.blocks[-1] if self._open else None
        if piece.kind == "arguments":
            if open_ is not None and open_["type"] == "tool_use":
                self._args += piece.text
                self._delta({"type": "input_json_delta", "partial_json": piece.text})
            return
        if piece.kind == "call":
            self.close()
            self._args = ""
            self._start({"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}})
            return
        kind = _KINDS[piece.kind]
        if open_ is None or open_["type"] != kind:
            self.close()
            self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                        else {"type": "text", "text": ""})
        field, delta = _BLOCKS[kind]
        self.blocks[-1][field] += piece.text
        self._delta({"type": delta, field: piece.text})

    def close(self) -> None:
        """Stop the open block, if any."""
        if not self._open:
            return
        self._open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = call_input(self._args)
        self._events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))

    def _start(self, block: dict) -> None:
        self._events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks),
                                                     "content_block": dict(block)}))
        self.blocks.append(block)
        self._open = True

    def _delta(self, delta: dict) -> None:
        self._events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                     "delta": delta}))


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stopped_by, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat answer that ended with ``finish_reason``, its
    ``stop_reason`` ``stopped_by`` (vLLM's: the stop string or token): ``stop_sequence`` when one of
    ``stop_sequences`` stopped it, else ``end_turn``, ``max_tokens`` or ``tool_use``."""
    if finish_reason == "stop" and isinstance(stopped_by, str) and stopped_by in (stop_sequences or ()):
        return "stop_sequence", stopped_by
    return _STOP.get(finish_reason, "end_turn"), None
