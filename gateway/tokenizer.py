"""The gateway's tokenizers: token strings for logprobs, ``/tokenize`` and ``/detokenize``.

The gateway renders what a worker's model scored (token ids and their
logprobs) as text, so it needs the served model's tokenizer. It never loads
one itself (the gateway package does not import ``worker/``): the CLI
injects a *loader*, ``load(name) -> Tokenizer | None``, called once per name
on a thread (loading takes seconds: it must not hold the event loop or the
server's start). ``name`` is :attr:`GatewayConfig.tokenizer` when set, else
the served model's own name, then each of its aliases until one loads (a
loader answers None for a name that is no local model, e.g. ``simulated``,
or a ``.gguf`` file's stem, served with the file's path as an alias).

Without a tokenizer, token strings are ``"token_id:N"`` (vLLM's
``--return-tokens-as-token-ids`` spelling) and ``/tokenize`` answers 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from gateway.threads import on_a_daemon_thread
from protocol.chat import template_error
from protocol.validation import echo, kind_of

log = logging.getLogger(__name__)


def token_id_string(token: int) -> str:
    """A token's string when no tokenizer is known: ``"token_id:N"`` (vLLM's spelling)."""
    return f"token_id:{token}"


class Tokenizer:
    """One model's text codec as the gateway uses it.

    - ``codec``: a ``TextCodec`` (``worker.models.base``: ``encode(text)``,
      ``apply_chat_template(messages)``, ``decode(ids, skip_special_tokens)``).
    - ``hf``: the transformers tokenizer under it, or None; it adds the
      option of ``/tokenize`` ``add_special_tokens=True`` for a chat, which a bare codec refuses.

    :meth:`token_str` is the decode of one token, special tokens kept (as
    vLLM's ``decoded_token``), cached: a vocabulary is a few 10,000 entries;
    :meth:`token_bytes` its bytes (chat's ``bytes``).
    Raises ValueError for text or messages the codec refuses.
    """

    def __init__(self, codec, hf=None) -> None:
        self.codec = codec
        self.hf = hf
        self._strs: dict[int, str] = {}
        self._bytes: dict[str, int] | None = None  # byte-level BPE: vocabulary character -> byte
        self._special: frozenset[int] = frozenset()
        self._templated: tuple[str, object] | None = None  # (a worker's --chat-template, the codec rendering it)

    def token_str(self, token: int) -> str:
        s = self._strs.get(token)
        if s is None:
            try:
                s = self.codec.decode([token], skip_special_tokens=False)
            except Exception:  # noqa: BLE001 -- an id the tokenizer does not know: say which
                s = token_id_string(token)
            self._strs[token] = s
        return s

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes (chat's ``bytes``): for a byte-level BPE (GPT-2's, Llama 3's,
        SmolLM's), the bytes its vocabulary entry stands for, so a token holding part of a
        multi-byte character gives those bytes, not U+FFFD's; else the UTF-8 of :meth:`token_str`."""
        table = self._byte_table()
        if table:
            piece = self.hf.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece and token not in self._special and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self.token_str(token).encode("utf-8", "replace"))

    def _byte_table(self) -> dict[str, int] | None:
        if self._bytes is None:
            self._bytes = {}
            decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
            if type(decoder).__name__ == "ByteLevel":
                from transformers.convert_slow_tokenizer import bytes_to_unicode

                self._bytes = {c: b for b, c in bytes_to_unicode().items()}
                self._special = frozenset(self.hf.all_special_ids)
        return self._bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            if self.hf is None:
                raise ValueError("add_special_tokens=false needs the model's transformers tokenizer")
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a string, got {kind_of(text)}")
            if not text:  # (the words of the codec's own refusal, with special tokens)
                raise ValueError("prompt text must not be empty")
            return list(self.hf.encode(text, add_special_tokens=False))
        return list(self.codec.encode(text))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True,
             add_special_tokens: bool = False, tools: list[dict] | None = None,
             template_kwargs: dict | None = None, template: str = "", *,
             continue_final_message: bool = False) -> list[int]:
        """The chat template's token ids (as a chat request's prompt is, with the generation prompt);
        ``continue_final_message``: the final message left open instead (a chat request's field of
        that name: pass ``add_generation_prompt=False`` with it);
        ``add_special_tokens``: the tokenizer's own BOS/EOS around them too (vLLM's, default off).
        ``messages`` as the worker renders them (an assistant's ``tool_calls`` with mapping arguments:
        :meth:`protocol.request.ChatMessage.template_dict`), ``tools`` OpenAI's definitions or None,
        ``template_kwargs`` extra template variables (a request's ``chat_template_kwargs``) or None,
        ``template`` the Jinja text the model's worker renders with in place of the tokenizer's
        (``ModelInfo.chat_template``, its ``--chat-template``), ``""`` for the tokenizer's own."""
        codec = self._codec_for(template)
        if not add_special_tokens:  # (the worker's rendering: its TextCodec, each flag only when it is set)
            kwargs = {"tools": tools} if tools else {}
            if template_kwargs:
                kwargs["template_kwargs"] = template_kwargs
            if not add_generation_prompt:
                kwargs["add_generation_prompt"] = False
            if continue_final_message:
                kwargs["continue_final_message"] = True
            return list(codec.apply_chat_template(messages, **kwargs))
        if self.hf is None:
            raise ValueError("add_special_tokens=true needs the model's transformers tokenizer")
        messages, kwargs = codec.chat_inputs(messages, tools, template_kwargs)  # checked; as the codec's
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:  # (transformers tokenizes the chat with add_special_tokens=False itself: passing it again is a
            # TypeError, "got multiple values for keyword argument 'add_special_tokens'", so they are added after)
            enc = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=True, sanitize_control_tokens=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- jinja errors, raise_exception() in templates
            raise template_error(exc, continue_final_message) from exc
        ids = list(enc["input_ids"])
        return self._with_special_tokens(ids) if add_special_tokens else ids

    def _codec_for(self, template: str):
        """The codec that renders chats with ``template`` (the tokenizer's own for ``""``), made once
        per template (the last one kept: a model's workers share theirs)."""
        if not template:
            return self.codec
        if self._templated is None or self._templated[0] != template:
            with_template = getattr(self.codec, "with_chat_template", None)
            if with_template is None:
                raise ValueError("this model's worker renders chats with its own --chat-template, which this "
                                 "gateway's tokenizer cannot take; leave messages out, or send a prompt")
            self._templated = (template, with_template(template))
        return self._templated[1]

    def _with_special_tokens(self, ids: list[int]) -> list[int]:
        """``ids`` inside the special tokens the tokenizer's post-processor puts around one sequence
        (its BOS before, EOS after: what ``encode(text, add_special_tokens=True)`` adds to a text's
        tokens, read off a one-character text). ValueError for a post-processor that does more."""
        bare = list(self.hf.encode("a", add_special_tokens=False))
        full = list(self.hf.encode("a", add_special_tokens=True))
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if not bare or at is None:
            raise ValueError("add_special_tokens=true: this tokenizer's special tokens are not added around "
                             "a sequence; leave it out")
        return full[:at] + ids + full[at + len(bare):]

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens kept (what vLLM's ``/detokenize`` and echo give)."""
        return self.codec.decode(list(tokens), skip_special_tokens=False)


Loader = Callable[[str], "Tokenizer | None"]


class Tokenizers:
    """The tokenizer of each served model, loaded once per name on a daemon thread (event loop only):
    a gateway that stops (its parent gone included) never waits for a load under way.

    ``load``: the CLI's loader, or None (no tokenizer for any model). ``name``:
    the one tokenizer to load for every model (``--tokenizer``), or None (each
    model's own name, then its aliases: ``names_of(model)`` gives them, the
    model first). A load that fails is logged once and its model has no
    tokenizer; :meth:`why_none` says why.
    """

    def __init__(self, load: Loader | None, name: str | None = None,
                 names_of: Callable[[str], Sequence[str]] | None = None) -> None:
        self._load = load
        self.name = name
        self._names_of = names_of or (lambda model: (model,))
        self._futures: dict[str, asyncio.Future] = {}
        self._tried: dict[str, tuple[str, ...]] = {}  # the names each future tries
        self._failed: dict[str, str] = {}

    def _key(self, model: str) -> str:
        return self.name or model

    def prefetch(self, model: str) -> None:
        """Start loading ``model``'s tokenizer, if not started (returns at once)."""
        if self._load is None:
            return
        key = self._key(model)
        names = (key,) if self.name else tuple(self._names_of(key))
        fut = self._futures.get(key)
        # Found none by the names known then (a model on demand, asked for before its worker said its
        # aliases, e.g. the .gguf path behind a --models-dir name): try again once there are new ones.
        if fut is None or names != self._tried[key] and fut.done() and not fut.cancelled() and \
                fut.exception() is None and fut.result() is None:
            self._tried[key] = names
            # (a daemon thread: a gateway stopping never waits for a load, seconds to minutes for a download)
            self._futures[key] = on_a_daemon_thread(self._load_one, key, names, name="slotserve-gateway-tokenizer")

    def _load_one(self, key: str, names: Sequence[str]) -> Tokenizer | None:
        """The first of ``names`` that loads (a model's own name, then its aliases), or None."""
        for name in names:
            try:
                tok = self._load(name)
            except Exception as e:  # noqa: BLE001 -- a bad --tokenizer: logged, that model renders token ids
                self._failed[key] = f"{type(e).__name__}: {e}"
                log.error("gateway: cannot load the tokenizer %r (%s); token strings are token_id:N", name, e)
                return None
            if tok is not None:
                log.info("gateway: tokenizer %r loaded", name)
                return tok
        return None

    async def get(self, model: str) -> Tokenizer | None:
        """``model``'s tokenizer (waits for its load), or None."""
        if self._load is None:
            return None
        self.prefetch(model)
        return await asyncio.shield(self._futures[self._key(model)])

    def loaded(self, model: str) -> Tokenizer | None:
        """``model``'s tokenizer if it has loaded already (no waiting, no load started), else None."""
        fut = self._futures.get(self._key(model))
        return fut.result() if fut is not None and fut.done() and not fut.cancelled() and \
            fut.exception() is None else None

    def why_none(self, model: str) -> str:
        key = self._key(model)
        if key in self._failed:
            return f"its tokenizer {echo(key)} failed to load ({self._failed[key]})"
        if self._load is None:
            return "this gateway was started without a tokenizer"
        return (f"no tokenizer is known for {echo(key)} (a local model's alias, folder or .gguf file is; "
                "start the gateway with --tokenizer)")
