"""The tool-call parsers, one per model family, chosen by name (``--tool-call-parser``, vLLM's names).

Every parser is a :class:`~gateway.call_stream.CallStream`: one choice's output in, OpenAI's
content and ``tool_calls`` deltas out, the same parse streamed or whole.

========================  ==============================================================================
name                      what the model writes (where the syntax is taken from)
========================  ==============================================================================
``hermes`` (the default)  ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` anywhere in the
                          answer (Hermes 2 Pro, Qwen2.5's templates; :class:`~gateway.tool_stream.ToolStream`)
``llama3_json``           ``{"name": N, "parameters": {...}}`` (or ``"arguments"``) as the whole answer,
                          optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1/3.2/3.3's
                          templates, "JSON based tool calling"; vLLM's ``llama_tool_parser.py``)
``mistral``               ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`` (Mistral 7B Instruct v0.3's
                          template) or ``[TOOL_CALLS]N[ARGS]{...}``, repeated per call (v11+ templates:
                          Mistral Small 3.x, Devstral; ``[CALL_ID]id`` before ``[ARGS]`` is skipped);
                          vLLM's ``mistral_tool_parser.py``
``qwen3_coder``           ``<tool_call>\\n<function=N>\\n<parameter=P>\\nVALUE\\n</parameter>\\n``...
                          ``</function>\\n</tool_call>`` (Qwen3-Coder's template; vLLM's ``qwen3coder_tool_parser.py``;
                          :mod:`gateway.tool_xml`)
``pythonic``              ``[N(k=VALUE, ...), ...]`` with Python literal values as the whole answer, optionally
                          after ``<|python_tag|>`` (Llama 3.2's and Llama 4's "[func_name1(params_name1=
                          params_value1...)]"; vLLM's ``pythonic_tool_parser.py``; :mod:`gateway.tool_pythonic`)
``openai``                gpt-oss's harmony messages to ``functions.N``: ``<|start|>assistant<|channel|>commentary
                          to=functions.N <|constrain|>json<|message|>{...}<|call|>`` (OpenAI's harmony format;
                          vLLM's ``openai_tool_parser.py``; :mod:`gateway.harmony`)
========================  ==============================================================================

``auto`` (``--tool-call-parser auto``, as llama.cpp's server picks its format): the parser the
model's chat template asks for (:func:`detect_parser`).

Where a marker may appear (vLLM's choices, followed): ``<tool_call>`` and ``[TOOL_CALLS]`` start
calls anywhere in the answer, the text before them is content; Llama 3's JSON is a call only as
the start of the answer (vLLM's streaming parser and llama.cpp's; a JSON object mid-answer is
the answer's text).
"""

from __future__ import annotations

import random
import re
import string

from gateway.call_stream import _MORE, _NAME_CHARS, _WS, CallStream, _header, is_name_start
from gateway.tool_stream import ToolStream
from protocol.validation import echo

__all__ = ["AUTO", "CHOICES", "DEFAULT", "PARSERS", "Llama3JsonStream", "MistralStream", "detect_parser",
           "parser_class"]

DEFAULT = "hermes"
"""The parser when none is named: today's (Qwen2.5, Hermes)."""


class Llama3JsonStream(ToolStream):
    """Llama 3.x's JSON tool calls: the answer *is* the calls, ``{"name": N, "parameters": {...}}``
    (Llama 3.1's template asks for ``parameters``; ``arguments`` is taken too, as is a leading
    ``"type": "function"`` that llama.cpp's parser also reads), optionally after ``<|python_tag|>``
    (the template's ``ipython`` turns), separated by ``;`` and whitespace (vLLM's
    ``Llama3JsonToolParser``). An answer that starts otherwise is content, whole; text after the
    calls is content; a call cut or broken after its arguments began keeps what it sent and the
    rest of the answer is dropped (:class:`~gateway.tool_stream.ToolStream`'s bare calls, whose
    rules these are). Always read, ``bare`` or not: this is the family's own syntax, and a call
    needs a given function's name, so a JSON answer is taken for one only when it is one."""

    __slots__ = ()
    OPEN = None
    SEPARATORS = ";"
    PREFIX = "<|python_tag|>"

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, True, forced)


class MistralStream(CallStream):
    """Mistral's tool calls after ``[TOOL_CALLS]`` (vLLM's ``MistralToolParser``), in either form:

    - before v11 (Mistral 7B Instruct v0.3): a JSON array of ``{"name": N, "arguments": {...}}``
      objects, an ``"id"`` after the arguments skipped (v0.3's template writes the history's
      calls so; ``"parameters"`` and a leading ``"type": "function"`` are taken too, as the other
      JSON parsers take them);
    - v11+ (Mistral Small 3.x, Devstral): ``N[ARGS]{...}`` (``[CALL_ID]id`` before ``[ARGS]`` is
      skipped; ``[ARGS]`` may be missing, as vLLM reads it), and ``[TOOL_CALLS]`` again per call.

    Text before ``[TOOL_CALLS]`` is content (as vLLM's), whitespace right before it dropped; what
    follows the marker that is not a call of one of ``functions`` stays content, marker and all.
    After the calls, text is content (v11) or, after the array's ``]``, too. A call broken after
    its arguments began keeps what it sent; the rest of the answer is dropped, as it is after the
    first call when ``parallel`` is False. A ``[TOOL_CALLS]`` before a call's arguments close
    (a special token: vLLM's parser splits the output at each) ends them there, in a JSON string
    too: the call keeps what it sent (finish reason ``stop``) and the next call is read on. Call
    ids are 9 letters and digits: Mistral's templates and ``mistral-common`` refuse others in the
    history the next turn sends back.

    ``bare=True`` (issue 33, item 5): an answer that *starts* with the array form without
    ``[TOOL_CALLS]`` -- ``[{"name": N, "arguments": {...}}, ...]``, what Mistral models write when
    they leave the marker out, as vLLM's and llama.cpp's Mistral parsers also read it -- is the
    calls too, held back until its first call's header says whether it is one (a known function's
    name); any other answer starting with ``[`` is content. Off where the answer may be JSON the
    user asked for (a ``response_format``)."""

    __slots__ = ("_state", "_array", "_brace")
    MARK = "[TOOL_CALLS]"

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, bare, forced)
        self._state = _TEXT
        self._array = False  # the calls are a JSON array (before v11)
        self._brace = False  # TAIL: the call object's "}" is still to come

    @staticmethod
    def _new_id() -> str:
        return "".join(random.choices(_ALNUM, k=9))  # mistral-common's rule, vLLM's MistralToolCall

    def _whole(self) -> bool:
        return self._state != _ARGS

    def _step(self, out: list[dict], final: bool) -> bool:
        state = self._state
        if state == _TEXT and self.bare:  # (at the answer's start: the array without its marker?)
            rest = self._buf.lstrip(_WS)
            head = _array_head(rest, self.functions) if rest.startswith("[") else None
            if not final and (not rest or head is _MORE):
                return False
            if head is _MORE and self._cut:  # a call cut off before its arguments (CallStream)
                self._buf, self._state = "", _DROP
                return True
            self.bare = False
            if isinstance(head, tuple):
                self._ws, self._buf, self._state = self._buf[:len(self._buf) - len(rest)], rest, _HEAD
                return True
        if state == _TEXT:
            found = self._content_until(out, (self.MARK,), final)
            if found is None:
                return False
            at = found[0]
            self._buf = self._buf[at + len(self.MARK):]
            self._state = _DROP if self.calls and not self.parallel else _HEAD
            return True
        if state in (_HEAD, _NEXT):
            if state == _HEAD:
                head = _array_head(self._buf, self.functions)
                head = _v11_head(self._buf, self.functions) if head is None else head
            else:
                skip = len(self._buf) - len(self._buf.lstrip(_WS))
                head = _header(self._buf[skip:], self.functions)
                head = (head[0], head[1] + skip, head[2], True) if isinstance(head, tuple) else head
            if head is _MORE and not final:
                return False
            if head is _MORE and self._cut:  # a call cut off before its arguments (CallStream)
                self._buf, self._ws, self._state = "", "", _DROP
                return True
            if not isinstance(head, tuple):
                if state == _NEXT:  # (in the array after a call: not a call, the rest is dropped)
                    self._buf, self._state = "", _DROP
                    return True
                self._say(out, self._ws + self.MARK)  # not a call: the marker is content, and read on
                self._ws, self._state = "", _TEXT
                return True
            name, end, has_args, self._array = head
            self._begin(out, name)
            self._buf = self._buf[end:]
            if has_args:
                self._state = _ARGS
            else:
                self._args(out, "{}")
                self._state, self._brace = _TAIL, False
            return True
        if state == _ARGS:  # to the "}" that closes them, or a [TOOL_CALLS] before it (the next call's)
            ended = self._args_until(out, (self.MARK,), final)
            if ended is None:
                return False
            self._state, self._brace = (_TAIL, True) if ended and self._array else (_TEXT, False)
            return True
        if state == _TAIL:  # (the array's) "}" of the call, then "," and the next call, or "]"
            rest = self._buf.lstrip(_WS)
            if self._brace and rest.startswith(","):  # its "id" first, as v0.3's template writes a call
                end = rest.find("}")
                if end < 0 and not final:
                    self._buf = rest
                    return False
                if end >= 0 and _ID_FIELD.fullmatch(rest[:end]):
                    rest = rest[end:]
            if self._brace and rest.startswith("}"):
                rest, self._brace = rest[1:].lstrip(_WS), False
            self._buf = rest
            if not rest:
                return False
            if self._brace or rest[0] not in ",]" or rest[0] == "," and not self.parallel:
                self._state = _DROP  # broken after a call, or one call only: the rest is dropped
            else:
                self._buf, self._state = rest[1:], (_NEXT if rest[0] == "," else _TEXT)
            return True
        self._buf = ""  # _DROP
        return False


_TEXT, _HEAD, _NEXT, _ARGS, _TAIL, _DROP = "text", "head", "next", "args", "tail", "drop"  # MistralStream's
_ALNUM = string.ascii_letters + string.digits
_ID_CHARS = re.compile(r"[A-Za-z0-9]*")
_ID_FIELD = re.compile(r',\s*"id"\s*:\s*"[A-Za-z0-9_-]*"\s*')


def _array_head(s: str, functions: dict[str, dict]) -> object:
    """After ``[TOOL_CALLS]``: the array form's first call ``(name, end, has_args, True)`` (``end``
    the index of its arguments' ``{``, or past a call without them), _MORE, or None."""
    t = s.lstrip(_WS)
    if not t:
        return _MORE
    if t[0] != "[":
        return None
    body = t[1:].lstrip(_WS)
    head = _header(body, functions)
    return (head[0], head[1] + len(s) - len(body), head[2], True) if isinstance(head, tuple) else head


def _v11_head(s: str, functions: dict[str, dict]) -> object:
    """After ``[TOOL_CALLS]``: the v11 form ``N([CALL_ID]id)?([ARGS])?{`` as ``(name, end, True,
    False)`` (``end`` the index of the ``{``), _MORE, or None (not that form, an unknown name)."""
    i = _NAME_CHARS.match(s).end()
    if i == len(s):
        return _MORE if is_name_start(s, functions) else None
    name = s[:i]
    if name not in functions:  # (a whole name: no call, whatever follows, as the text cut after its start said)
        return None
    for tag, chars in (("[CALL_ID]", _ID_CHARS), ("[ARGS]", None)):
        if i == len(s):
            return _MORE
        if s.startswith(tag, i):
            i += len(tag)
            if chars is not None:
                i = chars.match(s, i).end()
        elif tag.startswith(s[i:]):  # (the text ends inside the tag)
            return _MORE
    if i == len(s):
        return _MORE
    if s[i] != "{":
        return None
    return name, i, True, False


def parser_class(name: str) -> type[CallStream]:
    """The parser named ``name`` (one of :data:`PARSERS`). ValueError naming the choices for another."""
    try:
        return _CLASSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {echo(name)}") from None


def check_choice(name: object) -> str:
    """``name`` if it is one of :data:`CHOICES` (a parser's or ``auto``); ValueError naming them."""
    if name not in CHOICES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(CHOICES)}, got {echo(name)}")
    return name


def _others() -> dict[str, type[CallStream]]:
    """The parsers of their own modules (which import this one's helpers: imported here, after them)."""
    from gateway.harmony import HarmonyStream
    from gateway.tool_pythonic import PythonicStream
    from gateway.tool_xml import Qwen3CoderStream

    return {"qwen3_coder": Qwen3CoderStream, "pythonic": PythonicStream, "openai": HarmonyStream}


_CLASSES: dict[str, type[CallStream]] = {"hermes": ToolStream, "llama3_json": Llama3JsonStream,
                                         "mistral": MistralStream, **_others()}
PARSERS = tuple(_CLASSES)
"""The names ``--tool-call-parser`` takes (vLLM's names for the same syntaxes)."""
AUTO = "auto"
"""The choice that picks the parser from each model's chat template (:func:`detect_parser`)."""
CHOICES = PARSERS + (AUTO,)
"""The names ``--tool-call-parser`` takes: a parser's, or :data:`AUTO`."""


def detect_parser(template: str | dict | None) -> str:
    """The parser whose syntax the chat template ``template`` (Jinja text) writes a call in, read
    from the markers it renders, as llama.cpp's server tells its chat formats apart
    (``common/chat.cpp``): ``<|channel|>`` gpt-oss's harmony (``openai``); ``[TOOL_CALLS]``
    Mistral's; ``<function=`` with ``<parameter=`` Qwen3-Coder's; ``<tool_call>`` Hermes'; the
    pythonic format's own words (``[func_name1(params_name1=params_value1...)]``, Llama 3.2's
    and 4's), pythonic; else ``<|python_tag|>``, or an ``ipython`` role with ``"parameters"``,
    Llama 3's JSON. :data:`DEFAULT` for no template or none of them (the Hermes rendering of a
    template without tools). A tokenizer's several named templates (a dict) are read together."""
    t = " ".join(v for v in template.values() if isinstance(v, str)) if isinstance(template, dict) else template or ""
    if "<|channel|>" in t:
        return "openai"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "func_name1(" in t:
        return "pythonic"
    if "<|python_tag|>" in t or "ipython" in t and '"parameters"' in t:
        return "llama3_json"
    return DEFAULT
