"""Text in and out for Hugging Face models (a :class:`worker.models.base.TextCodec`).

Tokenisation, chat templates and decoding are delegated to the model's own
tokenizer (transformers / tokenizers); nothing is hand-rolled. Streamed text
uses the tokenizers library's ``DecodeStream``, which holds back bytes until
they form complete UTF-8 characters, so a multi-byte character split across
tokens is never emitted in pieces.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from protocol.chat import template_error
from worker.models.fim import render as fim_render
from worker.models.hermes import hermes_messages


class StreamDecoder:
    """Incremental detokeniser for one request (an ``IncrementalDecoder``).

    ``prompt_ids``: context to decode after (slotserve passes none: a
    request's text is the decode of its generated tokens, worker/text.py;
    note that tokenizers' ``DecodeStream`` may repeat the text of a seed that
    ends inside a character). ``step(token_id)`` returns the newly completed
    text, ``''`` while a character is still incomplete.
    """

    def __init__(self, backend, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        chunk = self._stream.step(self._backend, int(token_id))
        return chunk or ""


class HFTextCodec:
    """Wraps a transformers fast tokenizer.

    - ``encode(text) -> list[int]``: as ``tokenizer.encode`` (adds the
      model's special tokens, if its tokenizer is configured to).
    - ``apply_chat_template(messages, tools=None) -> list[int]``: the model's chat
      template with the generation prompt appended (``add_generation_prompt=False``: none;
      ``continue_final_message=True``: none, and the final message left open for the model to
      continue, transformers' ``continue_final_message``); ``messages`` is a list of
      ``{"role": str, "content": str}`` (an assistant's may add ``tool_calls``,
      :meth:`protocol.request.ChatMessage.template_dict`); ``tools``: OpenAI's
      tool definitions. A template that renders ``tools`` (its Jinja source uses
      the variable; transformers picks a ``tool_use`` template when there is one)
      renders the tools, the calls and the ``tool`` messages itself, as
      ``apply_chat_template(messages, tools=...)``; for one that does not
      (SmolLM2's) they are first written in the Hermes format
      (:func:`worker.models.hermes.hermes_messages`). The answer is read by
      the gateway's tool-call parser (``--tool-call-parser``: Hermes
      ``<tool_call>`` blocks by default, or the Llama 3, Mistral or
      Qwen3-Coder syntax its template asks for; gateway.tool_parsers).
      Only the template's own markers
      become control tokens: a control-token spelling inside a message (a
      user typing ``<|im_end|>``) is tokenised as plain text, so content can
      neither end its turn nor forge another (transformers'
      ``sanitize_control_tokens=True``, transformers >= 5.20).
    - ``decode(ids, skip_special_tokens=True) -> str``: special tokens such as
      EOS are left out of the text by default, as in vLLM's
      ``skip_special_tokens=True`` (the token ids still carry them), except
      the tool-call markers some tokenizers hold as special tokens (Mistral's
      ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, gpt-oss's harmony markers), which the gateway's
      parsers read (:mod:`worker.models.tool_markers`). Decoded
      by the tokenizers backend, as the stream is (transformers' own
      ``decode`` may also clean up spaces), so streamed pieces add up to it.
    - ``decoder(prompt_ids, skip_special_tokens=True) -> StreamDecoder``, likewise.
    - ``infill(prefix, suffix, extra=()) -> list[int]``: a fill-in-the-middle prompt in the model's
      own FIM tokens (:mod:`worker.models.fim`), ``fim_stop_ids`` their end tokens.

    Raises ``ValueError`` for a non-string text, malformed messages, a
    tokenizer without a chat template, or (for chat) a transformers release
    without ``sanitize_control_tokens``.
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._backend = tokenizer.backend_tokenizer
        # Older releases would pass the flag on to the template as a variable and sanitize nothing.
        self._sanitizes = "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters
        self._renders_tools: dict[str, bool] = {}  # template source -> whether it uses ``tools``
        self._template: str | None = None  # --chat-template's, replacing the tokenizer's
        self._fim = None  # FimTokens, or False once looked up and absent (worker.models.fim)
        self._literal = None  # the backend encoding special tokens as text (FIM prompts), made when first needed
        self._decoding = None  # the backend that decodes, tool-call markers kept as text (_decoder_backend)

    def with_chat_template(self, template: str) -> HFTextCodec:
        """A codec that renders chats with ``template`` (Jinja text) instead of the tokenizer's own
        (``--chat-template``): passed to transformers' ``apply_chat_template(chat_template=...)``, the
        tokenizer left as it is (loaders share it between models)."""
        out = type(self)(self._tok)
        out._template = template
        return out

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt text must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("prompt text must not be empty")
        return list(self._tok.encode(text))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        messages, kwargs = self.chat_inputs(messages, tools, template_kwargs)
        if continue_final_message:  # (transformers refuses it beside a generation prompt: the protocol does first)
            kwargs["continue_final_message"] = True
        try:
            enc = self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True,
                sanitize_control_tokens=True, **kwargs,
            )
        except Exception as exc:  # jinja errors, raise_exception() in templates
            raise template_error(exc, continue_final_message) from exc
        return list(enc["input_ids"])

    @property
    def chat_template_override(self) -> str:
        """The Jinja text this codec renders chats with in place of the tokenizer's template
        (:meth:`with_chat_template`, ``--chat-template``), ``""`` when it renders with the
        tokenizer's own (``ModelInfo.chat_template``: the gateway renders with the same)."""
        return self._template or ""

    @property
    def reasoning_format(self) -> str:
        """How the chat template lets the model think, as a reasoning parser's name
        (:data:`gateway.reasoning.PARSERS`): ``"deepseek_r1"`` when its generation prompt ends with
        ``<think>`` (the template opens the thinking: DeepSeek-R1 and its distills), ``"qwen3"`` when
        the template mentions ``<think>`` otherwise (the model opens it: Qwen3, QwQ),
        ``"openai_gptoss"`` when it writes harmony's ``<|channel|>`` (gpt-oss), ``""`` when it does
        not (no thinking), or has no template. Read from the template in use (``--chat-template``'s
        when given), as llama.cpp detects the format."""
        try:
            source = self._tok.get_chat_template(self._template)
        except ValueError:  # no template, or several and no default
            return ""
        if "<|channel|>" in source:
            return "openai_gptoss"
        if "<think>" not in source:
            return ""
        try:
            prompt = self._tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                   tokenize=False, **({} if self._template is None else
                                                                      {"chat_template": self._template}))
        except Exception:  # noqa: BLE001 -- a template that needs more than one user message: not the first case
            return "qwen3"
        return "deepseek_r1" if str(prompt).rstrip().endswith("<think>") else "qwen3"

    def chat_inputs(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> tuple[list[dict], dict]:
        """``(messages, kwargs)`` as the tokenizer's ``apply_chat_template(messages, **kwargs)`` renders
        this chat (see :meth:`apply_chat_template`; the gateway's ``/tokenize`` renders it with other
        flags): ``kwargs`` has ``tools`` for a template that renders them, else the messages are
        the Hermes rendering; and ``template_kwargs`` (extra template variables, e.g.
        ``enable_thinking``: transformers passes unknown keyword arguments to the template; names it
        sets itself are refused by the protocol, :data:`protocol.request.TEMPLATE_RESERVED`).
        ValueError as :meth:`apply_chat_template`."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"each message needs a str 'role' and a str 'content', got {m!r}")
        if not (self._template or self._tok.chat_template):
            raise ValueError("this model's tokenizer has no chat template: send a text prompt instead, or give its "
                             "worker one with --chat-template (a file, or the Jinja text itself)")
        if not self._sanitizes:
            raise ValueError("chat needs transformers >= 5.20 (apply_chat_template(sanitize_control_tokens=True)), "
                             "else message content could forge control tokens; upgrade it or send token ids")
        kwargs = dict(template_kwargs or {})
        if self._template is not None:
            kwargs["chat_template"] = self._template
        if self._template_renders_tools(tools):
            if tools:
                kwargs["tools"] = tools
        elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = hermes_messages(messages, tools)
        return messages, kwargs

    def _template_renders_tools(self, tools: list[dict] | None) -> bool:
        """Whether the template transformers picks for ``tools`` uses the ``tools`` variable."""
        try:
            source = self._tok.get_chat_template(self._template, tools=tools)
        except ValueError as exc:  # several named templates and no default
            raise ValueError(f"chat template: {exc}") from exc
        found = self._renders_tools.get(source)
        if found is None:
            found = self._renders_tools[source] = "tools" in _template_variables(source)
        return found

    def infill(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = ()) -> list[int]:
        """A fill-in-the-middle prompt's ids: ``prefix`` and ``suffix`` (text before and after the gap) and
        ``extra`` ((filename, text) chunks of other files) between the model's own FIM tokens
        (:mod:`worker.models.fim`; every text tokenised with special tokens split as plain text).
        :class:`~protocol.errors.UnsupportedError` (a ValueError) naming the tokens looked for when the
        tokenizer has no FIM tokens."""
        fim = self._fim_tokens()
        return fim_render(fim, self._literal_ids, prefix, suffix, extra, self._bos())

    @property
    def fim_stop_ids(self) -> tuple[int, ...]:
        """The FIM family's end tokens this tokenizer has (a FIM request's stop tokens besides the
        model's EOS); () without FIM tokens."""
        fim = self._fim_or_none()
        return () if fim is None else fim.ends

    def _fim_or_none(self):
        if self._fim is None:
            from worker.models.fim import fim_tokens

            specials = {t.content: i for i, t in self._tok.added_tokens_decoder.items() if t.special}
            self._fim = fim_tokens(specials) or False
        return self._fim or None

    def _fim_tokens(self):
        fim = self._fim_or_none()
        if fim is None:
            from protocol.errors import UnsupportedError
            from worker.models.fim import missing_message

            raise UnsupportedError(missing_message(self._tok.get_vocab()))
        return fim

    def _literal_ids(self, text: str) -> list[int]:
        """``text``'s ids with no special token added and none recognised (a copy of the backend with
        ``encode_special_tokens``: the shared one is never switched)."""
        if not text:
            return []
        if self._literal is None:
            from tokenizers import Tokenizer

            literal = Tokenizer.from_str(self._backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal.encode(text, add_special_tokens=False).ids

    def _bos(self) -> list[int]:
        """The ids the tokenizer puts before a text's own (its BOS, if it adds one)."""
        full = list(self._tok.encode("a"))
        bare = list(self._tok.encode("a", add_special_tokens=False))
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        return full[:at]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decoder_backend().decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decoder(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self._decoder_backend(), prompt_ids, skip_special_tokens)

    def _decoder_backend(self):
        """The backend that decodes: the tokenizer's own, or, where it holds tool-call markers as
        special tokens (Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``), a copy that keeps
        them in the text (:mod:`worker.models.tool_markers`; encoding and templates are unchanged)."""
        if self._decoding is None:
            from worker.models.tool_markers import kept_markers, markers_as_text

            self._decoding = self._backend
            added = list(self._backend.get_added_tokens_decoder().values())
            kept = kept_markers(t.content for t in added)
            if any(t.special and t.content in kept for t in added):
                from tokenizers import Tokenizer

                self._decoding = Tokenizer.from_str(markers_as_text(self._backend.to_str()))
        return self._decoding

    @functools.cached_property
    def _vocab(self) -> dict[str, int]:
        """token -> id, added tokens included (the backend's; what transformers' ``get_vocab`` returns),
        read once: ~0.15 s for Qwen2.5's 151,665 tokens, and both start-up scans below need it."""
        return self._backend.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """An upper bound on the text bytes one token stands for: the longest vocabulary entry's
        UTF-8 length (added tokens included; byte-level BPE's ``Ġ`` and SentencePiece's ``▁`` take
        more bytes than the byte they stand for, so it only over-counts), or None where the
        tokenizer normalises its input first (a normaliser may drop characters, so text bytes would
        bound nothing). A text of ``n`` bytes is then at least ``n / max_token_bytes`` tokens
        (``BatchInferenceEngine`` refuses a prompt that is too long by this before tokenising it)."""
        if self._backend.normalizer is not None:
            return None
        return max((len(t.encode("utf-8")) for t in self._vocab), default=0) or None

    def undefined_ids(self, vocab_size: int) -> tuple[tuple[int, int], ...]:
        """The ids in ``[0, vocab_size)`` (the model's embedding rows) that this tokenizer does not
        define, as sorted half-open ranges ``((start, stop), ...)``: ids it has no token for (a
        checkpoint's vocabulary padded to a multiple of 64 or 128: Qwen2.5's 151,665 tokens in 151,936
        rows), and ids whose token is llama.cpp's padding of such an id, ``[PAD<id>]`` at that id
        (``convert_hf_to_gguf.py`` writes one, of type UNUSED, for each id the original tokenizer
        lacked, and transformers' GGUF conversion reads it as an ordinary token). ``()`` when every
        id is defined."""
        defined = bytearray(vocab_size)
        for token, i in self._vocab.items():
            if 0 <= i < vocab_size and not (token.startswith("[PAD") and token == f"[PAD{i}]"):
                defined[i] = 1
        ranges, start = [], None
        for i, known in enumerate(defined):
            if not known and start is None:
                start = i
            elif known and start is not None:
                ranges.append((start, i))
                start = None
        if start is not None:
            ranges.append((start, vocab_size))
        return tuple(ranges)

    def tokenizer_json(self) -> str:
        """The tokenizer as the tokenizers library's JSON (added tokens included; padding and
        truncation off), what llguidance builds its tokenizer from (:mod:`worker.models.grammar`).
        Written from the kept tokenizer where both are off already (as transformers leaves them):
        a copy to switch them off costs a JSON round trip in the tokenizers library (~0.5 s for
        Qwen2.5's 151,665 tokens on a 2-core AMD EPYC), which every worker's warm-up paid."""
        backend = self._backend
        if backend.padding is not None or backend.truncation is not None:
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
        return backend.to_str()


def _template_variables(source: str) -> frozenset[str]:
    """The variables a Jinja chat template reads from its caller (``jinja2.meta``), parsed by
    transformers' own template environment where it offers one (it knows its extensions, such
    as ``{% generation %}``); else by plain Jinja; a source neither parses: the words in it."""
    import jinja2
    import jinja2.meta

    try:
        from transformers.utils.chat_template_utils import _get_template_variables  # private: guarded
    except ImportError:
        _get_template_variables = None
    try:
        if _get_template_variables is not None:
            return frozenset(_get_template_variables(source))
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset(re.findall(r"\w+", source))
