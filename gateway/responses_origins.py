"""Where each chat message of a ``/v1/responses`` conversation came from, in the Responses API's terms.

:mod:`gateway.responses_api` serves a Responses request as one chat request whose messages are
``instructions``, the stored conversation of ``previous_response_id`` (earlier responses' input and
output items) and this request's ``input`` items. The chat path names what it refuses by the chat's
fields (``messages.3.tool_calls.0.function.arguments``; its message says
``messages[3].tool_calls[0].function.arguments ...``), whose index is no Responses item's: an
assistant message joins a ``message`` item and the ``function_call`` items after it, ``reasoning``
items are left out, ``instructions`` come first. An :class:`Origin` per chat message keeps the
items it was made of, so such an error names the item the client knows: ``input[2].arguments``
(param ``input.2.arguments``), or ``output[0].arguments of stored response resp_...`` for an item
``previous_response_id`` replays (param ``input``: the field that holds the conversation; the
stored item itself cannot be changed, so the message says how to send it corrected).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.tools import shown

__all__ = ["ItemKind", "Origin", "renamed_to_items"]


class ItemKind(enum.Enum):
    """What a chat message's own item is: its fields' names differ (a tool message's ``content`` is a
    ``function_call_output`` item's ``output``)."""

    MESSAGE = "message"                # a message item, or a response's output: role, content
    TOOL_OUTPUT = "tool_output"        # a function_call_output item: call_id, output
    INSTRUCTIONS = "instructions"      # the request's instructions (the system message first)


@dataclass(frozen=True, slots=True)
class Origin:
    """The Responses items one chat message was made of. ``item``: the item of its role and content,
    as a param (``"input.2"``, ``"output.0"``, ``"instructions"``), or None (an assistant message
    made of ``function_call`` items alone); ``calls``: the ``function_call`` item of each of its
    tool calls, in order (``"input.3"``); ``kind``: what ``item`` is; ``response``: the id of the
    stored response whose input or output held the items, None for this request's own."""

    item: str | None
    calls: tuple[str, ...] = ()
    kind: ItemKind = ItemKind.MESSAGE
    response: str | None = None


_CHAT_FIELD = re.compile(r"messages\.(\d+)(.*)")
_CALL_FIELD = re.compile(r"\.tool_calls(?:\.(\d+))?(.*)")
_CALL_KEYS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id", ".type": ".type"}
_KEYS = {ItemKind.MESSAGE: {".content": ".content", ".role": ".role"},
         ItemKind.TOOL_OUTPUT: {".content": ".output", ".tool_call_id": ".call_id"},
         ItemKind.INSTRUCTIONS: {}}
_STORED_HINT = ("; previous_response_id replays the stored response as it is: send that conversation as input "
                "items instead (store: false), with this item corrected")


def renamed_to_items(e: APIError, origins: Sequence[Origin]) -> bool:
    """Rename ``e``, an error of the chat path whose ``param`` names a chat message
    (``messages.N...``; ``origins[N]`` its items), to the Responses item (in place): its ``param``
    (the item's field, or ``input`` for a stored item) and its message, whose leading chat field
    (``messages.N...`` or ``messages[N]...``) becomes the item's words, or which the item's words
    introduce when it names no field. Whether it was renamed (False: ``param`` names no chat
    message, or one without an origin)."""
    m = _CHAT_FIELD.fullmatch(e.param or "")
    if m is None or int(m[1]) >= len(origins):
        return False
    origin = origins[int(m[1])]
    field = _item_field(origin, m[2])
    if field is None:
        return False
    words = shown(field) + (f" of stored response {origin.response}" if origin.response is not None else "")
    for chat in (e.param, shown(e.param)):
        if re.match(re.escape(chat) + r"(?![\w.\[])", e.message):
            e.message = words + e.message[len(chat):]
            break
    else:
        e.message = f"{words}: {e.message}"
    if origin.response is not None:
        e.message += _STORED_HINT
    e.param = "input" if origin.response is not None else field
    return True


def _item_field(origin: Origin, rest: str) -> str | None:
    """The Responses field of ``rest`` (a chat message's field, ``.tool_calls.0.function.arguments``,
    ``.content``, or ``""`` for the message) in ``origin``'s items; the item itself for a key it
    has no field for."""
    call = _CALL_FIELD.fullmatch(rest)
    if call is not None:
        j = int(call[1] or 0)
        if j < len(origin.calls):
            return origin.calls[j] + (_CALL_KEYS.get(call[2], "") if call[1] is not None else "")
        return origin.item
    if origin.item is None:
        return origin.calls[0] if origin.calls else None
    key = re.match(r"\.\w+", rest)
    return origin.item + (_KEYS[origin.kind].get(key[0], "") if key else "")
