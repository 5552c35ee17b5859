"""A chat message's content as OpenAI's API takes it, checked once for every entry point.

OpenAI's ``ChatCompletionMessageParam``: ``content`` is a string, a list of content parts
(``{"type": "text", "text": ...}``; a chat template renders their texts joined), or null for an
assistant message (beside its tool calls: "Required unless ``tool_calls`` or ``function_call`` is
specified"). :func:`content_text` is the one rule: the HTTP gateway's chat routes and ``/tokenize``
(:func:`gateway.options.chat_messages`, which names the field of a refusal in its 4xx), the Python
SDK, ``slotserve run``'s rows and the wire (:class:`protocol.request.RequestParams`' chat prompt,
whose :class:`~protocol.request.ChatMessage` holds the joined text, ``""`` for none), so each takes
what the others take. :class:`Answers` is the rule of a ``tool`` message's ``tool_call_id`` for the
same entry points, in the same words.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Mapping

from protocol.validation import clip, echo, is_sequence, kind_of

__all__ = ["PART_TYPES", "AnswerError", "Answers", "ContentError", "Fault", "content_text", "template_error"]

PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")
"""The types of a chat message's content parts in OpenAI's API (its ``ChatCompletionContentPartParam``
and an assistant's ``refusal`` part); slotserve serves ``text``."""


class Fault(enum.Enum):
    """What kind of refusal a :class:`ContentError` is (an HTTP answer's code; ``unsupported``: a
    part OpenAI takes and slotserve does not serve, 501 over HTTP and the wire's ``unsupported``)."""

    TYPE = "invalid_type"
    MISSING = "missing_required_parameter"
    VALUE = "invalid_value"
    UNSUPPORTED = "unsupported"


class ContentError(ValueError):
    """A message's content refused by :func:`content_text`.

    - ``path``: the field at fault below the content, as keys: ``()`` the content itself, ``(1,)``
      its part 1, ``(1, "type")`` that part's type;
    - ``fault``: :class:`Fault`;
    - ``words``: what is wrong and what to send; they start after the field's name when ``leads``
      (``"is an empty array: ..."``), else they stand alone.

    ``str(e)`` names the field as ``content[1].type``; each caller names it as its clients do
    (:meth:`at`, :meth:`named`)."""

    def __init__(self, path: tuple, fault: Fault, words: str, *, leads: bool = False) -> None:
        self.path, self.fault, self.words, self.leads = path, fault, words, leads
        super().__init__(self.named(self.at("content")))

    def at(self, content: str) -> str:
        """The field at fault, below ``content`` (the content's own name, ``chat message 1 content``):
        ``chat message 1 content[1].type``."""
        return content + "".join(f"[{k}]" if type(k) is int else f".{k}" for k in self.path)

    def named(self, field: str) -> str:
        """The message, the field at fault written ``field``."""
        return f"{field} {self.words}" if self.leads else f"{field}: {self.words}"


def content_text(content: object, role: str) -> str:
    """The text a chat template renders of a message's ``content`` (see the module's docstring): a
    string as it is; null as ``""`` for an assistant message; the texts of a list of text parts,
    joined. :class:`ContentError` for null in another role's message, an empty list (OpenAI's rule:
    an array holds at least one part; ``""`` is taken), another type of content, or a part that is
    no object, has no string ``type``, is none of :data:`PART_TYPES` (:attr:`Fault.VALUE`), is one
    of OpenAI's other parts (an image, audio, a file, a refusal: :attr:`Fault.UNSUPPORTED`, slotserve
    serves text), or a text part without a string ``text``. Lone surrogates are the caller's to
    refuse (:func:`protocol.validation.as_text`)."""
    if type(content) is str:
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise ContentError((), Fault.VALUE, f"a {role} message needs content")
    null = ", null" if role == "assistant" else ""
    if isinstance(content, (str, bytes, Mapping)) or not is_sequence(content):
        raise ContentError((), Fault.TYPE, f"must be a string{null} or a list of text parts; got {kind_of(content)}",
                           leads=True)
    parts = list(content)  # type: ignore[call-overload]
    if not parts:  # (an empty turn the client did not mean: OpenAI refuses it, as Anthropic does)
        raise ContentError((), Fault.VALUE, f"is an empty array: an empty turn is refused; send a string{null} or a "
                           "list of at least one text part", leads=True)
    return "".join(_part_text(part, j) for j, part in enumerate(parts))


def _part_text(part: object, j: int) -> str:
    """The text of the content part ``part`` (the content's entry ``j``), which must be a text part."""
    if not isinstance(part, Mapping):
        raise ContentError((j,), Fault.TYPE, 'a content part must be an object whose "type" says what it is (text); '
                           f"got {_shown(part)}")
    if "type" not in part:
        raise ContentError((j, "type"), Fault.MISSING, 'a content part needs a "type" saying what it is (text)')
    kind = part["type"]
    if type(kind) is not str:
        raise ContentError((j, "type"), Fault.TYPE, f'a content part\'s "type" must be a string (text); got '
                           f"{_shown(kind)}")
    if kind in PART_TYPES[1:]:
        raise ContentError((j, "type"), Fault.UNSUPPORTED, f"{kind} content parts are not supported by slotserve "
                           "(text parts only); send the content as text, or leave the part out")
    if kind != "text":
        raise ContentError((j, "type"), Fault.VALUE, f"a content part's type is one of {', '.join(PART_TYPES)} "
                           f"(OpenAI's; slotserve serves text), not {echo(kind)}")
    text = part.get("text")
    if type(text) is not str:
        raise ContentError((j, "text"), Fault.TYPE if "text" in part else Fault.MISSING,
                           "a text content part needs a string 'text'")
    return text


def _shown(value: object) -> str:
    """``value`` (not an object) as a refusal shows it: an array by its kind, else its JSON, cut as
    every echo is (a value JSON cannot write, which only a Python caller sends: its repr)."""
    if isinstance(value, (list, tuple)):
        return kind_of(value)
    try:
        return clip(json.dumps(value))
    except (TypeError, ValueError):
        return echo(value)


def template_error(exc: Exception, continue_final_message: bool = False) -> ValueError:
    """What a chat that transformers' ``apply_chat_template`` refused says to the client: the
    template's own words (a Jinja error, its ``raise_exception``), except transformers' refusals of
    ``continue_final_message``, which are said here: one of them carries the whole rendered chat
    (after ``Rendered chat:``, the system prompt and the template's text), which is no client's to read."""
    text = str(exc)
    if continue_final_message and text.startswith("continue_final_message"):
        if "does not appear in the chat" in text:
            return ValueError("continue_final_message: the chat template changes or drops the final message's "
                              "text, so the reply cannot continue it; send the conversation without it")
        if "has no" in text or "could not find any text" in text:  # (no such field; none of its text)
            return ValueError("continue_final_message: the final message has no text to continue")
        return ValueError("continue_final_message: this chat template cannot continue the final message")
    return ValueError(f"chat template rejected the messages: {text}")


class AnswerError(ValueError):
    """A message refused by :class:`Answers`: ``index``, the message; ``call_id``, its
    ``tool_call_id`` (``""``: none); ``earlier``, for a call answered twice the index of the tool
    message that answered it first (else None); ``unanswered``, for an assistant message (``index``)
    whose calls the tool messages after it do not all answer, the ids of those calls (``""`` for
    one sent without an id; else empty), and ``after`` the message that came instead (None: the
    chat ended). ``str(e)`` names the messages as the Python SDK and the wire do (``chat message 3
    tool_call_id: ...``); :meth:`said` as another entry point does."""

    def __init__(self, index: int, call_id: str, earlier: int | None = None, *, unanswered: tuple[str, ...] = (),
                 after: int | None = None) -> None:
        self.index, self.call_id, self.earlier, self.unanswered, self.after = index, call_id, earlier, unanswered, after
        field = f"chat message {index} {'tool_calls' if unanswered else 'tool_call_id'}"
        super().__init__(self.said(lambda i: f"chat message {i}", field))

    def said(self, message: Callable[[int], str], field: str) -> str:
        """The refusal, a message named ``message(i)`` (``messages[2]``) and the field at fault named
        ``field``: the tool message's ``tool_call_id`` (``messages[3].tool_call_id``), or the assistant
        message's ``tool_calls`` when some are unanswered (``messages[1].tool_calls``)."""
        if self.unanswered:
            ids = ", ".join(echo(c) if c else "(a call sent without an id)" for c in self.unanswered)
            where = "before the chat ends" if self.after is None else f"before {message(self.after)}"
            return (f"{field}: An assistant message with 'tool_calls' must be followed by tool messages responding "
                    f"to each 'tool_call_id'. The following tool_call_ids did not have response messages: {ids}; "
                    f"send a tool message answering each right after {message(self.index)} ({where}), or leave "
                    "the calls out")
        if not self.call_id:
            return (f"{field}: a tool message needs the tool_call_id of the call it answers; give the id of that "
                    "call (the assistant message's tool_calls[].id)")
        if self.earlier is None:
            return (f"{field}: {echo(self.call_id)} is the id of no tool call in an earlier assistant message: give "
                    "the id of the call this message answers (and the assistant message with that call before it)")
        return (f"{field}: Duplicate value for 'tool_call_id' of {echo(self.call_id)}, in {message(self.earlier)} and "
                f"{message(self.index)}: one tool message answers a call; leave the second out")


class Answers:
    """The rule of a ``tool`` message's ``tool_call_id`` and of an assistant message's calls, fed a
    chat's messages in order (:meth:`check`, then :meth:`end`), one rule at every entry point: the
    HTTP chat route and ``/tokenize`` (:func:`gateway.tools.render_messages`), the Python SDK,
    ``slotserve run``'s rows and the wire (:class:`protocol.request.RequestParams`' chat prompt).

    A tool message names the call it answers: a ``tool_call_id`` (OpenAI requires it) that is the
    id of a call of an earlier assistant message (OpenAI and Anthropic refuse a result that answers
    no call the model made; a call sent without an id, ``""``, may be answered by any id), and one
    tool message answers a call (OpenAI: "Duplicate value for 'tool_call_id'"); a call made again
    later, by its id, may be answered again. An assistant message's calls are each answered by the
    tool messages right after it, before any other message and before the chat ends (OpenAI: "An
    assistant message with 'tool_calls' must be followed by tool messages responding to each
    'tool_call_id'"; Anthropic: "`tool_use` ids were found without `tool_result` blocks immediately
    after"): a chat template writes a call's result after it, and a call left unanswered is a
    conversation the model never saw. The ``/v1/responses`` and ``/v1/messages`` routes check their
    items first, in their vendors' words."""

    def __init__(self) -> None:
        self.made: set[str] = set()  # the ids of the calls so far ("" for a call sent without one)
        self.answered: dict[str, int] = {}  # a call's id -> the tool message that answered it, since the call was made
        self.waiting: list[str] = []  # the ids of the last assistant message's calls not answered yet, in order
        self.asked = 0  # the index of that assistant message

    def check(self, i: int, role: str, call_ids: Iterable[str], tool_call_id: str) -> None:
        """Take chat message ``i``: its ``role``, the ids of its tool calls, its ``tool_call_id``
        (``""``: none). :class:`AnswerError` for a tool message without an id, with the id of no
        earlier call, or answering a call a tool message answered already, and for another message
        while calls of the assistant message before it are unanswered."""
        if role != "tool" and self.waiting:
            raise AnswerError(self.asked, "", unanswered=tuple(self.waiting), after=i)
        calls = list(call_ids)
        for call_id in calls:
            self.made.add(call_id)
            self.answered.pop(call_id, None)
        if calls:
            self.waiting, self.asked = calls, i
        if role != "tool":
            return
        if not tool_call_id or tool_call_id not in self.made and "" not in self.made:
            raise AnswerError(i, tool_call_id)
        if tool_call_id in self.answered:
            raise AnswerError(i, tool_call_id, self.answered[tool_call_id])
        if tool_call_id in self.made:
            self.answered[tool_call_id] = i
        if tool_call_id in self.waiting:
            self.waiting.remove(tool_call_id)
        elif "" in self.waiting:  # (a call sent without an id: any id answers it)
            self.waiting.remove("")

    def end(self) -> None:
        """The chat ended after the messages taken: :class:`AnswerError` when calls of its last
        assistant message are unanswered."""
        if self.waiting:
            raise AnswerError(self.asked, "", unanswered=tuple(self.waiting))
