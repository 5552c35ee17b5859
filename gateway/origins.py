"""Where each chat message of a translated request came from, in its vendor's terms (``/v1/responses``'
items, ``/v1/messages``' messages and blocks).

:mod:`gateway.responses_api` and :mod:`gateway.messages_api` serve a request as one chat request,
whose checks name what they refuse by the chat's fields (``messages.3.tool_calls.0.function.arguments``;
the message says ``messages[3].tool_calls[0].function.arguments ...``), whose index is not the
vendor's: an instruction or system prompt comes first; a Responses assistant message joins a
``message`` item and the ``function_call`` items after it, and ``reasoning`` items are left out; a
Messages ``tool_use`` block is a call of its assistant message, a user message's ``tool_result``
blocks become ``tool`` messages of their own, before its text. An :class:`Origin` per chat message
keeps what it was made of, so such an error names the field the client sent:

- Responses: ``input[2].arguments`` (param ``input.2.arguments``), or ``output[0].arguments of stored
  response resp_...`` for an item ``previous_response_id`` replays (param ``input``: the field that
  holds the conversation; the stored item itself cannot be changed, so the message says how to send
  it corrected);
- Messages: ``messages.2.content.1.input`` (the param too: Anthropic's errors write a field dotted).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.tools import shown

__all__ = ["Api", "ItemKind", "Origin", "renamed_to_items"]


class Api(enum.Enum):
    """Whose fields :func:`renamed_to_items` names: a call's keys, and how the message writes a field."""

    RESPONSES = "responses"  # function_call items (name, arguments, call_id); words input[2].arguments
    MESSAGES = "messages"    # tool_use blocks (name, input, id); words messages.2.content.1.input


class ItemKind(enum.Enum):
    """What a chat message's own item is: its fields' names differ (a tool message's ``content`` is a
    ``function_call_output`` item's ``output``, a ``tool_result`` block's ``content``)."""

    MESSAGE = "message"                # a message (item), or a response's output: role, content
    TOOL_OUTPUT = "tool_output"        # a Responses function_call_output item: call_id, output
    TOOL_RESULT = "tool_result"        # a Messages tool_result block: tool_use_id, content
    INSTRUCTIONS = "instructions"      # a prompt field of its own (instructions, system): the system message


@dataclass(frozen=True, slots=True)
class Origin:
    """What one chat message was made of. ``item``: the item (or message, or block) of its role and
    content, as a param (``"input.2"``, ``"output.0"``, ``"instructions"``, ``"messages.1"``,
    ``"messages.2.content.0"``), or None (an assistant message made of ``function_call`` items
    alone); ``calls``: the ``function_call`` item or ``tool_use`` block of each of its tool calls, in
    order (``"input.3"``, ``"messages.1.content.2"``); ``kind``: what ``item`` is; ``response``: the
    id of the stored response whose input or output held the items, None for this request's own."""

    item: str | None
    calls: tuple[str, ...] = ()
    kind: ItemKind = ItemKind.MESSAGE
    response: str | None = None


_CHAT_FIELD = re.compile(r"messages\.(\d+)(.*)")
_CALL_FIELD = re.compile(r"\.tool_calls(?:\.(\d+))?(.*)")
_CALL_KEYS = {Api.RESPONSES: {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id",
                               ".type": ".type"},
              Api.MESSAGES: {".function.arguments": ".input", ".function.name": ".name", ".id": ".id",
                             ".type": ".type"}}
_KEYS = {ItemKind.MESSAGE: {".content": ".content", ".role": ".role"},
         ItemKind.TOOL_OUTPUT: {".content": ".output", ".tool_call_id": ".call_id"},
         ItemKind.TOOL_RESULT: {".content": ".content", ".tool_call_id": ".tool_use_id"},
         ItemKind.INSTRUCTIONS: {}}
_STORED_HINT = ("; previous_response_id replays the stored response as it is: send that conversation as input "
                "items instead (store: false), with this item corrected")


def renamed_to_items(e: APIError, origins: Sequence[Origin], api: Api = Api.RESPONSES) -> bool:
    """Rename ``e``, an error of the chat path whose ``param`` names a chat message
    (``messages.N...``; ``origins[N]`` what it came from), to ``api``'s field (in place): its
    ``param`` (the item's field, or ``input`` for a stored item) and its message, whose leading chat
    field (``messages.N...`` or ``messages[N]...``) becomes the field's words, or which the field's
    words introduce when it names no field. Whether it was renamed (False: ``param`` names no chat
    message, or one without an origin)."""
    m = _CHAT_FIELD.fullmatch(e.param or "")
    if m is None or int(m[1]) >= len(origins):
        return False
    origin = origins[int(m[1])]
    field = _item_field(origin, m[2], _CALL_KEYS[api])
    if field is None:
        return False
    words = (field if api is Api.MESSAGES else shown(field)) + (
        f" of stored response {origin.response}" if origin.response is not None else "")
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


def _item_field(origin: Origin, rest: str, call_keys: dict[str, str]) -> str | None:
    """The vendor's field of ``rest`` (a chat message's field, ``.tool_calls.0.function.arguments``,
    ``.content``, or ``""`` for the message) in ``origin``'s items, a call's keys by ``call_keys``;
    the item itself for a key it has no field for."""
    call = _CALL_FIELD.fullmatch(rest)
    if call is not None:
        j = int(call[1] or 0)
        if j < len(origin.calls):
            return origin.calls[j] + (call_keys.get(call[2], "") if call[1] is not None else "")
        return origin.item
    if origin.item is None:
        return origin.calls[0] if origin.calls else None
    key = re.match(r"\.\w+", rest)
    return origin.item + (_KEYS[origin.kind].get(key[0], "") if key else "")
