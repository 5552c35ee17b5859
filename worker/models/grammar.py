"""Structured outputs on the worker: grammars compiled by llguidance, one matcher per slot, batched masks.

The grammar engine is a library, llguidance (guidance-ai/llguidance, the
``llguidance`` wheel; vLLM ships it as a structured-output backend): it turns
a JSON schema, a regex, a list of choices, a Lark grammar or a llama.cpp
GBNF grammar (converted to Lark by ``llguidance.gbnf_to_lark``) into a
matcher over the model's own tokens, and fills the bitmask of the tokens
allowed next. Nothing here parses JSON schemas or regexes.

One :class:`Grammars` per model (a runner's ``grammars`` attribute, shared
with its :class:`~worker.models.sampling.Sampler`):

- its llguidance tokenizer is built from the model's tokenizer (the
  tokenizers library's JSON, its EOS tokens the model's), once:
  :meth:`Grammars.prepare`, which the worker's warm-up calls
  (:mod:`worker.warmup`), else the first constrained request. It holds the
  GIL throughout (~0.25 s for SmolLM2's 49,152 tokens; Qwen2.5's 151,665
  took 5-8.5 s on a loaded 2-core machine, up to 4.2 s in one call), so built
  by a request's submit on the worker's I/O thread it silenced that
  worker's heartbeats past the broker's 5 s liveness: the worker was
  declared lost and the requests it held were moved;
- :meth:`Grammars.compile` turns a :class:`~protocol.structured.Constraint`
  into a pristine matcher, cached by constraint (the cache is the model's, so
  the key is (model, grammar)) with a bound of ``cache_entries``: a second
  request with the same schema compiles nothing (a ``deep_copy`` of the
  cached matcher, ~10 us). A spec that does not compile raises
  :class:`GrammarError` (a ValueError, ``bad_request`` on the wire), which
  the engine raises at submit, before the request is queued;
- per slot, the matcher of the request in it, synchronised lazily with the
  slot's sequence (as the penalties' token counts are,
  :mod:`worker.models.processors`): at a row's first mask it is built and
  fed the row's output so far (``tokens[prompt_len:]``: resumed tokens of a
  migrated request included, so the matcher is rebuilt from them), then each
  mask feeds it the tokens appended since (the one the engine accepted last
  time). :meth:`Grammars.release` drops it with the slot;
- :meth:`Grammars.prefetch` (the engine calls it before each model step)
  syncs the batch's constrained rows' matchers and fills their bitmasks in
  one llguidance call (``LLExecutor``: rows in parallel, outside the GIL) on
  a thread, while the model's forward runs; :meth:`Grammars.mask` (from the
  sampler) takes them -- or fills its own, for rows the prefetch did not
  cover -- and applies them to the rows' logits in one masked fill: a token
  the grammar forbids gets ``-inf``.

JSON is generated in OpenAI's compact style, ``{"a": 1, "b": [2, 3]}``
(separators ``", "`` and ``": "``, no other whitespace: a free whitespace
rule lets a small model pad forever); a schema's own ``x-guidance``
options override this (llguidance's ``defaults`` -> ``x-guidance`` order).
Where the grammar may end, the model's EOS tokens are allowed (llguidance's
tokenizer's EOS), and a request's explicit stop tokens too
(``SamplingParams.structured_stops``), so it ends ``stop``; a request cut by
``max_tokens`` first ends ``length`` with its output unfinished, as the
engine reports it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from protocol.enums import ErrorCode
from protocol.request import SamplingParams
from protocol.structured import HARMONY_ANALYSIS, Constraint
from protocol.validation import echo
from worker.errors import ModelError
from worker.models.base import SlotInput

__all__ = ["CACHE_ENTRIES", "GrammarError", "GrammarMismatch", "Grammars", "grammars_for"]

log = logging.getLogger(__name__)

CACHE_ENTRIES = 256
"""Compiled grammars kept per model (least recently used dropped first)."""

_JSON_DEFAULTS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "gbnf": "gbnf"}


class GrammarError(ValueError):
    """A request's ``structured`` spec does not compile (the message says why); ``bad_request``."""

    code = ErrorCode.BAD_REQUEST


class GrammarMismatch(ModelError):
    """A constrained row's tokens left its grammar (e.g. resumed tokens it does not accept); that
    request ends with ``finish_reason="error"``, the rest of the batch goes on."""


def grammars_for(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars | None:
    """A :class:`Grammars` for a model whose ``tokenizer`` (a text codec with ``tokenizer_json()``) is
    known, else None (no structured outputs: a model without a tokenizer, or llguidance missing)."""
    if tokenizer is None or not callable(getattr(tokenizer, "tokenizer_json", None)):
        return None
    try:
        import llguidance  # noqa: F401  (the hf extra pins it)
    except ImportError:
        return None
    return Grammars(tokenizer.tokenizer_json, vocab_size, tuple(eos_token_ids))


class _Row:
    """One slot's matcher: its request's ``constraint``, and how many tokens of the slot's sequence
    it has consumed (``synced``, an index into ``SlotInput.tokens``)."""

    __slots__ = ("constraint", "matcher", "synced")

    def __init__(self, constraint: Constraint, matcher, synced: int) -> None:
        self.constraint, self.matcher, self.synced = constraint, matcher, synced


class Grammars:
    """One model's structured outputs (see the module docstring).

    - ``tokenizer_json``: a callable giving the tokenizer as the tokenizers library's JSON text
      (called once, at the first compile).
    - ``vocab_size``: the logits' width; token ids past the tokenizer's are never allowed.
    - ``eos_token_ids``: allowed where a grammar may end.

    Statistics for benchmarks: ``compiles`` (new grammars built), ``hits`` (cache hits),
    ``compile_s`` (seconds spent building), ``mask_s`` (seconds spent syncing, filling and
    applying masks), ``mask_calls`` (iterations with a constrained row), ``masks`` (rows masked),
    ``prefetched`` (iterations whose masks the prefetch had filled).
    """

    def __init__(self, tokenizer_json, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_entries: int = CACHE_ENTRIES) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_entries = cache_entries
        # guards the cache, held for lookups and inserts only: a build runs outside it (seconds for a
        # large grammar, on the admission thread) while the engine loop's rows look theirs up
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # the llguidance tokenizer is built once
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._rows: dict[int, _Row] = {}
        self._words = (vocab_size + 31) // 32
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._pool = None  # one thread that fills prefetched masks (prefetch); an Executor, tests set their own
        # (rows, future) of the last prefetch. Invariant: its rows' matchers belong to the fill thread
        # until _wait() consumes it (llguidance raises 'Already mutably borrowed' on any call meanwhile),
        # so mask, prefetch and release call _wait() before touching a matcher.
        self._pending = None
        self.compiles = self.hits = self.masks = self.mask_calls = self.prefetched = 0
        self.compile_s = self.mask_s = 0.0

    # ---- compiling

    def prepare(self) -> float:
        """Build the llguidance tokenizer now (seconds it took; 0.0 when built already), so that
        no request pays it: the worker's warm-up calls this before the model is served. Raises what
        llguidance raises for a tokenizer it cannot read (the first compile would raise it too)."""
        if self._tokenizer is not None:
            return 0.0
        start = time.perf_counter()
        self._llg()
        return time.perf_counter() - start

    def _llg(self):
        """The llguidance tokenizer and executor, built at first use (once, whichever thread asks)."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    import llguidance

                    eos = list(self.eos_token_ids) or None
                    tokenizer = llguidance.LLTokenizer(llguidance_json(self._tokenizer_json()),
                                                       n_vocab=self.vocab_size, eos_token=eos)
                    self._executor = llguidance.LLExecutor()
                    self._tokenizer = tokenizer  # (last: a thread that sees it sees the executor)
        return self._tokenizer

    def compile(self, constraint: Constraint):
        """A pristine llguidance ``LLMatcher`` for ``constraint`` (the cached one: copy it before
        feeding it tokens). Raises :class:`GrammarError` when the spec does not compile.

        The build runs outside the cache's lock: it takes seconds for a large grammar (a 109,588-
        character GBNF grammar: 8-9.7 s, on the worker's admission thread), and held there it stalled
        the engine loop, whose rows look their compiled constraint up here when a constrained request
        takes a slot: every slot waited for another request's build. Two threads building one
        constraint at once build it twice; the first one cached is kept."""
        with self._lock:
            matcher = self._cache.get(constraint)
            if matcher is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return matcher
        start = time.perf_counter()
        built = self._build(constraint)
        with self._lock:
            self.compile_s += time.perf_counter() - start
            self.compiles += 1
            matcher = self._cache.setdefault(constraint, built)
            self._cache.move_to_end(constraint)
            if len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
            return matcher

    def _build(self, constraint: Constraint):
        import llguidance

        kind, spec, think = constraint
        where = f"structured {kind}"
        try:
            if kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', _JSON_DEFAULTS)
            elif kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, _JSON_DEFAULTS)
            else:
                grammar = llguidance.grammar_from(_FORMATS[kind], spec)
        except ValueError as e:  # a GBNF grammar that does not convert, a schema llguidance refuses
            raise GrammarError(f"{where} does not compile{_said(str(e), constraint)}") from None
        answer = grammar
        if think:
            grammar = after_thinking(grammar, think)
        matcher = llguidance.LLMatcher(self._llg(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{where} does not compile{_said(matcher.get_error(), constraint)}")
        # its first mask, on a copy: a spec that compiles can still fail there (a schema that only
        # refers to itself, {"$ref": "#"}; a lexer past llguidance's item limit), which once ended
        # the request at its first token as a model error (HTTP 500), not as a bad request. After a
        # thinking format the first mask is the thinking's, which hides such an answer (the request
        # then thinks, and can never answer, up to max_tokens): the answer's grammar is probed alone.
        probe = matcher.deep_copy() if not think else llguidance.LLMatcher(self._llg(), answer, log_level=0)
        bits = self._fill([probe])
        if probe.is_error():
            raise GrammarError(f"{where} admits no output the grammar engine can produce (a schema with no "
                               f"finite instance, such as one that only refers to itself, or too large a "
                               f"lexer){_said(probe.get_error(), constraint)}")
        if not bool(bits.any()) and not probe.is_accepting():
            raise GrammarError(f"{where} admits no output: no token can start it")
        return matcher

    # ---- slots

    def release(self, slot: int) -> None:
        """The slot's request is gone: its matcher too (and any prefetched mask, now stale)."""
        self._rows.pop(slot, None)
        if self._pending is not None:
            self._wait()

    def _row(self, params: SamplingParams, item: SlotInput) -> _Row:
        """The slot's matcher, synced with its sequence (built, or rebuilt for a new occupant)."""
        row = self._rows.get(item.slot)
        if row is None or row.constraint != params.structured or len(item.tokens) < row.synced:
            row = self._rows[item.slot] = _Row(params.structured, self.compile(params.structured).deep_copy(),
                                               item.prompt_len)
        if len(item.tokens) > row.synced:
            new = item.tokens[row.synced:]
            row.synced = len(item.tokens)
            row.matcher.consume_tokens(new)
        return row

    # ---- masks

    def mask(self, scores: torch.Tensor, params: Sequence[SamplingParams], inputs: Sequence[SlotInput] | None
             ) -> dict[int, ModelError]:
        """Set ``scores[r, t] = -inf`` for every token ``t`` the grammar of constrained row ``r``
        forbids (rows whose ``params[r].structured`` is None are untouched).

        - ``scores``: fp32 ``[R, vocab]``, modified in place (a copy of the raw logits).
        - ``params[r]``, ``inputs[r]``: row ``r``'s sampling and slot (ValueError when ``inputs``
          is None and a row is constrained).

        Returns ``{r: error}`` for the rows whose tokens left their grammar
        (:class:`GrammarMismatch`); the caller ends those requests alone.
        """
        start = time.perf_counter()
        rows = [r for r, p in enumerate(params) if p.structured is not None]
        if inputs is None:
            raise ValueError("constrained rows need their slot inputs (the grammar follows each slot's tokens)")
        self._llg()
        prefetched = self._wait()  # first: its thread may still be using the rows' matchers
        failed: dict[int, ModelError] = {}
        matchers = []
        for r in rows:
            try:
                row = self._row(params[r], inputs[r])
            except GrammarError as e:  # (compiled at submit; only a cache eviction gets here)
                failed[r] = GrammarMismatch(str(e))
                continue
            if row.matcher.is_error():
                failed[r] = GrammarMismatch("the request's tokens no longer match its structured constraint: "
                                            f"{_first_lines(row.matcher.get_error())}")
                continue
            matchers.append((r, row.matcher))
        if matchers:
            bits = None if prefetched is None else self._match(*prefetched, [(inputs[r], m) for r, m in matchers])
            if bits is None:
                bits = self._fill([m for _, m in matchers])
            else:
                self.prefetched += 1
            for i, (r, m) in enumerate(matchers):
                stops = params[r].structured_stops
                if stops and m.is_accepting():
                    _allow(bits, i, stops, self.vocab_size)
            self._apply(scores, [r for r, _ in matchers], bits)
            self.masks += len(matchers)
        self.mask_calls += 1
        self.mask_s += time.perf_counter() - start
        return failed

    def _fill(self, matchers: list) -> torch.Tensor:
        """The bitmasks of ``matchers`` (int32 ``[n, words]``), in one llguidance call (rows in
        parallel on its threads, outside the GIL)."""
        bits = torch.zeros((len(matchers), self._words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(),
                                               self._words * 4, len(matchers))
        return bits

    def prefetch(self, batch: Sequence[SlotInput]) -> None:
        """Start filling the bitmasks of ``batch``'s constrained rows on a thread, so that they are
        computed while the model's forward runs (llguidance drops the GIL); :meth:`mask` takes them
        when the rows are the same (slot, matcher, tokens), else computes its own. The engine calls
        this before each model step; a batch without constrained rows costs one scan."""
        items = [item for item in batch if item.sampling.structured is not None]
        if not items or self._tokenizer is None:
            return
        self._wait()  # (a previous one nobody took)
        rows = []
        for item in items:
            try:
                row = self._row(item.sampling, item)
            except GrammarError:
                continue
            if not row.matcher.is_error():
                rows.append((item.slot, row.matcher, len(item.tokens)))
        if not rows:
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="slotserve-grammar")
        self._pending = (rows, self._pool.submit(self._fill, [m for _, m, _ in rows]))

    def _wait(self) -> tuple[list, torch.Tensor] | None:
        """The last prefetch's ``(rows, bitmasks)``, waited for and consumed (None when there is none).

        A fill that raised is logged and dropped (None): :meth:`mask` then fills its own, so an
        error that persists ends that batch from the sampler like any model error, and a release
        or a new prefetch, which only discard it, never raise (a release that raised would leave
        the slot's cache row to its next occupant: the runners free it after the sampler's)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rows, future = pending
        try:
            return rows, future.result()
        except Exception:
            log.warning("a prefetched grammar mask fill failed; its rows are filled again when sampled", exc_info=True)
            return None

    def _match(self, rows: list, bits: torch.Tensor, wanted) -> torch.Tensor | None:
        """The prefetched bitmasks when they are those of ``wanted`` (``(SlotInput, matcher)`` per
        row, in order), else None."""
        if len(rows) != len(wanted):
            return None if len(rows) < len(wanted) or not wanted else self._pick_rows(rows, bits, wanted)
        for (slot, m, n), (item, matcher) in zip(rows, wanted):
            if slot != item.slot or m is not matcher or n != len(item.tokens):
                return self._pick_rows(rows, bits, wanted)
        return bits

    def _pick_rows(self, rows, bits: torch.Tensor, wanted) -> torch.Tensor | None:
        """The rows of ``bits`` for ``wanted`` (a subset of the prefetched rows, e.g. without the
        rows still prefilling), or None when one is missing."""
        at = {(slot, id(m), n): i for i, (slot, m, n) in enumerate(rows)}
        index = [at.get((item.slot, id(matcher), len(item.tokens))) for item, matcher in wanted]
        if not wanted or None in index:
            return None
        return bits[index]

    def _apply(self, scores: torch.Tensor, rows: list[int], bits: torch.Tensor) -> None:
        """One masked fill: ``bits`` (int32 ``[n, words]``, bit ``t % 32`` of word ``t // 32`` set
        for an allowed token) over ``scores[rows]``."""
        device, vocab = scores.device, scores.shape[-1]
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        words = bits.to(device, non_blocking=True)
        allowed = ((words[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
        if allowed.shape[-1] < vocab:  # logits wider than the tokenizer: the rest is never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
        if len(rows) == scores.shape[0]:
            scores.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long, device=device)
            scores.index_copy_(0, index, scores.index_select(0, index).masked_fill_(~allowed, float("-inf")))


_THINKING = {
    # qwen3: the model may open a <think> block, closed once, then the answer (Qwen3, QwQ)
    "qwen3": "start: THINK? @{answer}\n"
             "THINK: /<think>(.|\\n)*<\\/think>[ \\t\\n]*/ & ~/(.|\\n)*<\\/think>(.|\\n)*<\\/think>(.|\\n)*/\n",
    # deepseek_r1: the template opened the thinking; the output is thinking up to its one </think>
    # (a <think> written again at its start is allowed, as the reasoning parser drops it), then the answer
    "deepseek_r1": "start: THINK @{answer}\n"
                   "THINK: /(<think>)?(.|\\n)*<\\/think>[ \\t\\n]*/ & ~/(.|\\n)*<\\/think>(.|\\n)*<\\/think>(.|\\n)*/\n",
    # openai_gptoss: gpt-oss's harmony: analysis messages (each up to its one <|end|> and the next message's
    # <|start|>assistant), then the answer in the final channel (gateway.harmony)
    "openai_gptoss": f"start: ANALYSIS* \"<|channel|>final<|message|>\" @{{answer}}\n{HARMONY_ANALYSIS}",
}


def after_thinking(grammar: str, think: str) -> str:
    """``grammar`` (llguidance's top-level grammar JSON or Lark text, as ``grammar_from`` gives it) applied to the
    answer after a thinking model's thinking, in the format of reasoning parser ``think`` (``qwen3``,
    ``deepseek_r1``, ``openai_gptoss``: analysis messages, then the answer in the ``final`` channel;
    :mod:`gateway.reasoning`): a Lark grammar first whose start is the thinking and
    then ``@answer``, a reference to ``grammar``'s own start grammar, named ``answer`` unless it has a name (llguidance's
    grammar references, docs/syntax.md of guidance-ai/llguidance). The thinking is one lexeme, from
    ``<think>`` to the first ``</think>`` and the blanks after it (the intersection with the
    complement of "two ``</think>``": any text without a second one), so a token that spans the end
    tag and the blanks (Qwen's ``>\\n\\n``) is allowed. ValueError for another ``think``."""
    import json

    if think not in _THINKING:
        raise ValueError(f"think must be one of {sorted(_THINKING)}, got {echo(think)}")
    try:
        top = json.loads(grammar)
    except ValueError:  # (grammar_from gives some formats as Lark text)
        top = None
    if not isinstance(top, dict) or "grammars" not in top:
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = top["grammars"]
    name = first.get("name") or "answer"  # (a name the other grammars may refer to is kept)
    lark = _THINKING[think].replace("{answer}", name)
    top["grammars"] = [{"lark_grammar": lark}, {**first, "name": name}, *rest]
    return json.dumps(top)


def _allow(bits: torch.Tensor, i: int, tokens: Sequence[int], vocab: int) -> None:
    """Set the bits of ``tokens`` in row ``i`` of an int32 bitmask."""
    for t in tokens:
        if 0 <= t < vocab:
            word = (int(bits[i, t >> 5]) & 0xFFFFFFFF) | (1 << (t & 31))
            bits[i, t >> 5] = word - (1 << 32) if word >= 1 << 31 else word


CACHE_MIN_CHARS = 1 << 20
"""Tokenizer JSONs shorter than this (characters) are not cached (:func:`llguidance_json`): they
cost little (SmolLM2's 49,152 tokens, 1.5 M characters: 0.06 s), and tests' small tokenizers would
fill the cache."""


def llguidance_json(tokenizer_json: str) -> str:
    """:func:`text_added_tokens` of ``tokenizer_json``, kept in slotserve's cache (``<cache
    root>/llguidance/<key>.json``, :mod:`worker.models.cache_root`) so that a worker starting
    again with the same tokenizer reads it instead of computing it: for Qwen2.5's 151,665 tokens
    (4.6 M characters of JSON) the standard library's parse and dump took 0.5-0.8 s of every
    worker's warm-up on a 2-core AMD EPYC, the cached file's read and the key 0.04 s. The key is
    the SHA-256 of the tokenizer JSON and of this module's and
    :mod:`worker.models.tool_markers`' sources (what decides the result), so a changed tokenizer
    or rule never reads another's file. The file is written whole, once
    (:func:`worker.models.cache_file.write_once`); a cache that cannot be named (no home folder to
    be found), read or written is passed by (the result is computed), never an error."""
    import hashlib
    from pathlib import Path

    from worker.models import tool_markers
    from worker.models.cache_file import write_once
    from worker.models.cache_root import cache_root

    if len(tokenizer_json) < CACHE_MIN_CHARS:
        return text_added_tokens(tokenizer_json)
    digest = hashlib.sha256(tokenizer_json.encode("utf-8", "surrogatepass"))
    try:
        for source in (__file__, tool_markers.__file__):
            digest.update(Path(source).read_bytes())
        root = cache_root()
    except OSError:  # (sources not on disk; no cache folder: cache_root's FileNotFoundError)
        return text_added_tokens(tokenizer_json)
    target = root / "llguidance" / f"{digest.hexdigest()[:40]}.json"
    try:
        text = target.read_text(encoding="utf-8")
        if _whole_object(text):
            return text
    except (OSError, UnicodeDecodeError):
        pass
    result = text_added_tokens(tokenizer_json)

    def write(path: Path) -> None:
        with open(path, "w", encoding="utf-8") as out:
            out.write(result)
            out.flush()
            os.fsync(out.fileno())  # (on disk before the rename: a power cut leaves no empty file)

    def complete(path: Path) -> bool:
        try:
            return _whole_object(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            return False

    try:
        write_once(target, write, complete)
    except OSError as exc:
        log.info("llguidance's tokenizer JSON not cached (%s): computed at each start", exc)
    return result


def _whole_object(text: str) -> bool:
    """Whether a cached tokenizer JSON was written whole: a JSON object's text, from its opening brace
    to its closing one (a file torn on a disk that lost its last writes is empty or cut short: it is
    written again, never given to llguidance)."""
    return text.startswith("{") and text.rstrip().endswith("}")


def text_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer JSON llguidance is given: each added token that is *not* special (``"special":
    false``: Qwen2.5's ``<tool_call>``/``</tool_call>``, Qwen3's ``<think>``) moved into the model's
    vocabulary, so that llguidance reads it as the text it stands for, as transformers decodes it.

    llguidance treats every added token as a special token (its bytes a marker and its id, which
    no quoted literal of a grammar matches), while the tokenizer encodes that text as the added
    token: a grammar asking for ``"<tool_call>"`` then allowed the token by its text and refused
    it when fed (the 500 of issue 33 on Qwen2.5-Coder with ``tool_choice: "required"``). Special
    added tokens (``<|im_end|>``, FIM and control tokens) stay special: a grammar never emits them
    as text. Only a vocabulary held as ``{piece: id}`` (BPE, WordPiece, WordLevel) is changed, each
    piece written as that vocabulary writes text (byte-level BPE's byte alphabet, SentencePiece's
    ``▁`` for a space); other tokenizers are returned unchanged. The special added tokens are
    written into the vocabulary too (and stay special): the tokenizers library gives an added token
    that is in no vocabulary the next free id, which the moved ones shift (a special token whose id
    lies below a moved one's was renumbered: ``<|end|>`` 256 read as 262). The tool-call markers that some
    tokenizers hold as special tokens (Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, gpt-oss's
    harmony markers: :func:`~worker.models.tool_markers.kept_markers`) are text too, as the worker decodes them:
    a tool-call grammar asks for them by their text (``gateway.tool_grammars``)."""
    import json

    from worker.models.tool_markers import kept_markers

    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    kept = kept_markers(t.get("content") for t in data.get("added_tokens") or ())
    plain = [t for t in data.get("added_tokens") or () if not t.get("special") or t.get("content") in kept]
    if not plain or not isinstance(vocab, dict):
        return tokenizer_json
    spell = _piece_spelling(data)
    for t in plain:
        piece = spell(t["content"])
        if vocab.get(piece, t["id"]) != t["id"]:  # the text is another token's piece: leave it special
            continue
        vocab[piece] = t["id"]
        t["_moved"] = True
    data["added_tokens"] = [t for t in data["added_tokens"] if not t.pop("_moved", False)]
    for t in data["added_tokens"]:  # the special ones keep their ids: the tokenizers library gives an added
        vocab.setdefault(spell(t["content"]), t["id"])  # token it finds in no vocabulary the next free id
    return json.dumps(data, ensure_ascii=False)


def _piece_spelling(data: dict):
    """How the tokenizer's vocabulary writes a text as a piece: byte-level BPE maps each UTF-8 byte
    to its printable stand-in (GPT-2's table); a SentencePiece-style one writes spaces as ``▁``."""
    kinds = set()
    for k in ("decoder", "pre_tokenizer"):
        part = data.get(k) or {}
        kinds.add(part.get("type"))
        kinds.update(d.get("type") for d in [*(part.get("decoders") or ()), *(part.get("pretokenizers") or ())])
    if "ByteLevel" in kinds:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        table = bytes_to_unicode()
        return lambda text: "".join(table[b] for b in text.encode("utf-8"))
    if "Metaspace" in kinds or "Replace" in kinds:
        return lambda text: text.replace(" ", "\u2581")
    return lambda text: text


def _first_lines(message: str, limit: int = 400) -> str:
    """An llguidance error, short enough for an error reply: what it says before the parser state
    llguidance appends (``<state>`` ... ``</state>``, rows, lexer counters, the grammar: the
    engine's internals, not the client's business), without the grammar's source lines a Lark
    error quotes after its position (``at 2(7): ...`` then ``   2 | call: %json {...}`` and a
    caret: the gateway's own tool-call grammar, for a tool whose schema fails), its lines joined
    with spaces (a regex error's detail follows its first line: ``regex parse error: ([ ^ error:
    unclosed character class``)."""
    head = message.strip().split("\n<state>", 1)[0]
    lines = head.splitlines()
    if lines and _LARK_AT.match(lines[0]):
        lines = [line for line in lines if not _QUOTED_SOURCE.match(line)]
    message = " ".join(" ".join(line.split()) for line in lines if line.strip())
    return message if len(message) <= limit else message[:limit] + " ..."


def _said(message: str, constraint: Constraint) -> str:
    """llguidance's error about ``constraint`` in words that refer only to what the client wrote,
    as the tail of a refusal (``": ..."``, or ``""`` when nothing of it is left):
    :func:`_first_lines` of it, then

    - a Lark position (``at 1(8): ``) dropped unless the spec is the client's own Lark grammar:
      for a regex, a choice, a JSON schema or a GBNF grammar it is a line and column of the Lark
      llguidance wrote from it (``at 1(8): invalid regex ...`` for the regex ``(?=a)``), which the
      client never saw (a tool-call grammar's is the gateway's, which drops it there);
    - serde_json's ``recursion limit exceeded at line 1 column 3026`` (a line and column of the JSON
      text llguidance read, the schema inside its own wrapping) said as what it means;
    - a bare identifier (``NoExtensionBias``: the name of llguidance's internal error variant, all
      it says of a grammar with no finite output) left out: the refusal's own words say it."""
    said = _first_lines(message)
    at = _LARK_AT.match(said)
    if at and not _own_lark(constraint):
        said = said[at.end():]
    said = _JSON_DEPTH.sub(_JSON_DEPTH_WORDS, said)
    return "" if not said or _IDENTIFIER.fullmatch(said) else f": {said}"


def _own_lark(constraint: Constraint) -> bool:
    """Whether ``constraint``'s spec is Lark text that llguidance reads as written (kind ``grammar``,
    not a GBNF grammar it converts), so positions in its errors are the client's lines."""
    if constraint.kind != "grammar":
        return False
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(constraint.spec) == constraint.spec
    except Exception:  # noqa: BLE001 -- (only on the error path) a text the converter chokes on: not plain Lark
        return False


_JSON_DEPTH = re.compile(r"recursion limit exceeded at line \d+ column \d+")
_JSON_DEPTH_WORDS = ("nested too deeply: the grammar engine reads JSON at most 128 levels of objects and arrays "
                     "deep, its own wrapping of the schema included")
_IDENTIFIER = re.compile(r"[A-Z][A-Za-z0-9]*")
_LARK_AT = re.compile(r"at \d+\(\d+\): ")  # a Lark grammar's error: its line(column) first
_QUOTED_SOURCE = re.compile(r"\s*(\d+ \| |\^\s*$)")  # then the grammar's lines around it, a caret under
