"""LlamaRunner: slotserve's own Llama-family model runner (a :class:`~worker.models.base.SlotModel`).

Per iteration (:meth:`LlamaRunner.step`):

1. Sort the batch: a slot with exactly one token the cache has not seen
   decodes; a slot with more (a new prompt, or the rest of a long one) is a
   prefill candidate.
2. Chunked prefill as the engine planned it (``BatchPlan.chunks``,
   :mod:`worker.planner`: at most :attr:`LlamaRunner.prefill_budget` prompt
   tokens per iteration): each candidate's chunk starts where its cache row
   ends -- for a new prompt, after the prefix it takes from the prefix cache
   (reported as ``StepOutput.cached_tokens``). A slot whose prompt is not
   finished this iteration gets no token (see :mod:`worker.models.base`).
3. One forward for everything (:func:`worker.models.llama.model.forward`,
   over a step plan built by :mod:`worker.models.llama.plan`), or on CUDA a
   prefill forward plus the decode step replayed from a CUDA graph
   (:mod:`worker.models.llama.cuda_graphs`).
4. One :class:`~worker.models.sampling.Sampler` call for all rows that need a
   token (one host synchronisation).

Speculative decoding (``speculative_tokens > 0``, CPU): before step 3, each
plain greedy decode row (no logits processor) gets up to that many draft tokens looked up in its own
tokens (:mod:`worker.models.llama.lookup`); the forward computes the row's
token and its drafts as consecutive queries of the decode attention (one
``[rows * queries]`` layout, padding where a row has fewer), and the row
returns its picks while they equal its drafts, plus one more
(:meth:`LlamaRunner._accept`). Each kept token is the model's greedy pick
after the tokens before it, so the output is what decoding without drafts
gives, up to floating-point rounding of the batched products (tested equal
to transformers' greedy ``generate``). A step then costs more (every
linear has a row per draft token: measured at 8 slots and 4 drafts, 65 vs
42 ms) and gives each row 1 to ``1 + speculative_tokens`` tokens, so the
drafts a step keeps are those expected to raise its tokens per second
(``draft_costs``, :mod:`worker.models.llama.draft_policy`: the step's cost
fitted from its decode-only steps, the acceptance counted per match length).

Logprobs (``SlotInput.logprobs``): the sampler scores the rows that ask
(:meth:`~worker.models.sampling.Sampler.pick_scored`, from the raw logits),
so such a row gets the full LM head, never the screened one; a drafted row
keeps drafting, and each token it returns carries the entry of its own query
row (the one a draft-free step computes). ``prompt_logprobs``
(``SlotInput.prompt_logprobs``): each prompt chunk of a row that asks adds
its positions to the logits rows (``logits_at``, LM head over those
positions only; a chunk's last position predicts the next chunk's first
token), scored in the same iteration (:func:`~worker.models.sampling.score`)
and kept per cache row until the prompt's last chunk, whose step gives
them (``StepOutput.prompt_logprobs``). Such a row never loads KV from the
prefix cache (all its positions need logits).

Slots map to cache rows lowest-free-first, so the decoding rows stay packed
at the bottom of the cache and the decode attention reads a view of rows
``0..n-1``; a row in that range that is not decoding is padding.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from worker.models.base import BatchPlan, SlotInput, StepOutput
from worker.models.grammar import grammars_for
from worker.models.heap import trim_heap
from worker.models.llama.cache import SlotCache
from worker.models.llama.draft_policy import DraftCosts
from worker.models.llama.lookup import PromptLookup
from worker.models.llama.model import forward
from worker.models.llama.plan import Chunk, Draft, add_prefill, decode_inputs, step_plan
from worker.models.llama.prefix_cache import PrefixCache, default_budget_mb, skips_cache
from worker.models.llama.weights import LlamaWeights
from worker.models.rows import SlotRows
from worker.models.sampling import Sampler, score
from worker.models.threads import ThreadTuner
from worker.models.transfer import to_device


class _Prefill(NamedTuple):
    """A batch entry with more than one token the cache has not seen."""

    fresh: bool  # nothing of it in the cache yet
    row: int  # cache row
    start: int  # tokens already in the cache


class LlamaRunner:
    """A Llama-family causal LM run by slotserve (see module docstring).

    Attributes read by the engine: ``vocab_size``, ``max_seq_len``,
    ``eos_token_ids``, ``tokenizer``, ``gives_logprobs`` (True: it gives
    ``StepOutput.logprobs`` / ``prompt_logprobs``, see the module docstring),
    ``prefill_budget``. Also ``device``, ``precision``, ``weights`` (:class:`LlamaWeights`), ``kv_cache`` (None before
    :meth:`bind_slots`), ``max_prefill_tokens``, ``kv_dtype`` (the KV cache's and the prefix
    cache's element type; None: the weights' activation dtype).

    ``capacity_step``: None maps the KV cache whole (see
    :mod:`worker.models.llama.cache`); a number makes it grow in such steps (CPU).

    ``speculative_tokens`` (attribute, read at every iteration; CPU): up to
    that many draft tokens per greedy decode row and iteration, looked up in
    the row's own tokens (:mod:`worker.models.llama.lookup`) and verified in
    the same forward; the row then gets several tokens in its :class:`StepOutput`
    (its accepted drafts and one more), see :mod:`worker.models.base`. 0 (the
    default) turns it off.

    ``draft_costs`` (attribute): the :class:`~worker.models.llama.draft_policy.DraftCosts` that
    chooses which draft tokens a step keeps and learns from the steps; None keeps every draft the
    lookup finds.

    ``thread_tuner`` (attribute, None: the thread count is left as it is): a
    :class:`~worker.models.threads.ThreadTuner` that is told each step's shape once its rows are
    known, sets torch's thread count for the rest of it, and is told its time after it (the
    loader sets one where the count cannot change the results: :func:`worker.models.load_model`).
    """

    gives_logprobs = True

    def __init__(self, weights: LlamaWeights, *, tokenizer=None, eos_token_ids: tuple[int, ...] = (),
                 max_prefill_tokens: int = 512, capacity_step: int | None = None,
                 speculative_tokens: int = 0, kv_dtype: torch.dtype | None = None) -> None:
        self.weights = weights
        self.kv_dtype = weights.act_dtype if kv_dtype is None else kv_dtype
        self.device, self.precision = weights.device, weights.precision
        self.vocab_size = weights.shape.vocab
        self.max_seq_len = weights.shape.context
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_prefill_tokens = max_prefill_tokens
        self.speculative_tokens = speculative_tokens
        self._lookup = PromptLookup(0)
        self._drafts: dict[int, Draft] = {}  # this iteration's, by batch index
        self._matched: dict[int, int] = {}  # this iteration's drafts' match lengths, by batch index
        # which drafts pay (worker.models.llama.draft_policy); None: every draft the lookup finds
        self.draft_costs: DraftCosts | None = DraftCosts()
        self._query_rows = 0  # the last forward's decode rows and draft tokens
        self._cached: dict[int, int] = {}  # this iteration's prefix cache hits: batch index -> prompt tokens
        self._capacity_step = capacity_step
        self._sampler = Sampler()
        # structured outputs (worker.models.grammar); None without a tokenizer. Read by the engine at submit.
        self.grammars = self._sampler.grammars = grammars_for(tokenizer, self.vocab_size, self.eos_token_ids)
        self.kv_cache: SlotCache | None = None
        self._rows = SlotRows()
        self._graphs = None
        self._prompt_logits, self._prompt_spans = None, ()  # this iteration's prompt_logprobs rows
        self._prompt_scores: dict[int, list] = {}  # cache row -> its prompt's entries so far
        self.prefix_cache_mb: float | None = None  # read at bind_slots: None sized from the machine, 0 off
        self.prefix_cache: PrefixCache | None = None  # worker.models.llama.prefix_cache
        self._seqs: dict[int, list[int]] = {}  # cache row -> its occupant's tokens (the prefix cache stores them)
        self._shape = (0, 0, 0)  # the last forward's shape: decode rows (a power of two), prompt and draft tokens
        self.thread_tuner: ThreadTuner | None = None  # set by the loader where the thread count may vary (threads.py)
        self._step_start: float | None = None  # perf_counter() when this step's tuned part began

    # -- SlotModel ---------------------------------------------------------

    def bind_slots(self, num_slots: int) -> None:
        """Allocate the KV cache for ``num_slots`` slots (and capture CUDA graphs on CUDA)."""
        s = self.weights.shape
        self.kv_cache = SlotCache(
            layers=s.layers, rows=num_slots, kv_heads=s.kv_heads, head_dim=s.head_dim, max_len=s.context,
            dtype=self.kv_dtype, device=self.device,
            capacity_step=None if self.device != "cpu" else self._capacity_step)  # None: whole, lazily on CPU
        self._rows = SlotRows(num_slots)
        self._lookup = PromptLookup(num_slots)
        self._sampler.bind(num_slots)
        self._prompt_scores = {}
        # per cache row: a token of its request went non-finite (see model.forward)
        self._failed = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        mb = default_budget_mb(self.device) if self.prefix_cache_mb is None else self.prefix_cache_mb
        self.prefix_cache = PrefixCache(self.kv_cache, mb, self.precision) if mb else None
        self._seqs = {}
        if self.device == "cuda":
            from worker.models.llama.cuda_graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self.weights, self.kv_cache)

    def release_slot(self, slot: int) -> None:
        """Free the slot's cache row; when it was the last one in use, return freed heap to the OS."""
        self._sampler.release(slot)
        row = self._rows.release(slot)
        if row is not None:
            self._prompt_scores.pop(row, None)
            if self.prefix_cache is not None:
                self._store(row, self._seqs.pop(row, ()))
                self.prefix_cache.release(row)
            self.kv_cache.clear(row)
            self._failed[row] = 0
            self._lookup.reset(row)
            if self._rows.idle:
                trim_heap()  # idle: the iterations' freed temporaries leave the RSS (see worker.models.heap)

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of KV cache one slot reserves: keys and values of every layer for ``max_seq_len``
        positions in :attr:`kv_dtype` (on CPU address space, backed as positions are written)."""
        s = self.weights.shape
        return 2 * s.layers * s.kv_heads * s.head_dim * self.max_seq_len * self.kv_dtype.itemsize

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens per iteration the engine may plan (``max_prefill_tokens``; see :mod:`worker.planner`)."""
        return self.max_prefill_tokens

    def step(self, plan: BatchPlan) -> StepOutput:
        """Run ``plan`` (its decodes and prompt chunks in one forward, one sampler call); return
        what it computed for each entry of ``plan.batch`` (see :mod:`worker.models.base`).

        Raises ValueError if a sequence outgrows ``max_seq_len``, RuntimeError
        before :meth:`bind_slots`.
        """
        self._step_start = None  # set by forward_batch once the tuner has given the step's threads
        start = time.perf_counter()
        out = self._step(plan)
        end = time.perf_counter()
        if self.thread_tuner is not None and self._step_start is not None:
            self.thread_tuner.record(self._shape, end - self._step_start)
        if self.speculative_tokens and self.draft_costs is not None and self._query_rows and not self._shape[1]:
            self.draft_costs.record_step(self._query_rows, end - start)  # a decode-only step's cost
        return out

    def _step(self, plan: BatchPlan) -> StepOutput:
        batch = plan.batch
        with torch.inference_mode():
            logits, out_index = self.forward_batch(batch, greedy_only=True, chunks=plan.chunks)
            out = StepOutput([None] * len(batch), more={}, logprobs={}, prompt_logprobs={},
                             cached_tokens=self._cached, errors={})
            if self._prompt_spans:
                self._score_prompts(batch)
            if out_index:
                picks, scored = self._pick(batch, logits, out_index)
                if self._drafts:
                    self._accept(out, out_index, picks, scored, batch)
                else:
                    _one_each(out, out_index, picks, scored, batch)
                for i in dict.fromkeys(out_index):  # a prompt scored over its chunks: all of it, with its first token
                    if batch[i].prompt_logprobs is not None:
                        out.prompt_logprobs[i] = [None] + self._prompt_scores.pop(self._rows.of[batch[i].slot], [])
        return out

    def _pick(self, batch: Sequence[SlotInput], logits: torch.Tensor, out_index: list[int]
              ) -> tuple[list, list | None]:
        """One sampler call for the logits rows (``out_index``: their batch entries): each row's
        pick (a token id, or the error of a non-finite row) and, when a row asks ``logprobs``,
        each row's entry (None for a row that does not ask), else None."""
        params = [batch[i].sampling for i in out_index]
        positions = [len(batch[i].tokens) for i in out_index]
        rows = to_device([self._rows.of[batch[i].slot] for i in out_index], torch.long, self.device)
        failed = self._failed.index_select(0, rows) > 0
        inputs = [batch[i] for i in out_index]
        if any(si.logprobs is not None for si in inputs):
            return self._sampler.pick_scored(logits, params, positions, failed, inputs,
                                             [si.logprobs for si in inputs])
        return self._sampler.pick(logits, params, positions, failed, inputs), None

    def _score_prompts(self, batch: Sequence[SlotInput]) -> None:
        """``prompt_logprobs``: this iteration's prompt entries (``self._prompt_logits``, the
        rows of ``self._prompt_spans``, scored in one :func:`score` call), kept per cache row
        until the prompt's last chunk (a chunk from position 0 starts the row afresh)."""
        targets, tops = [], []
        for i, first, count in self._prompt_spans:
            item = batch[i]
            targets += item.tokens[first:first + count]
            tops += [item.prompt_logprobs] * count
        entries, at = score(self._prompt_logits, targets, tops), 0
        for i, first, count in self._prompt_spans:
            row = self._rows.of[batch[i].slot]
            got = entries[at:at + count]
            at += count
            if first == 1:
                self._prompt_scores[row] = got
            else:
                self._prompt_scores.setdefault(row, []).extend(got)

    def _accept(self, out: StepOutput, out_index: list[int], picks: list, scored: list | None,
                batch: Sequence[SlotInput]) -> None:
        """Each logits row's tokens into ``out`` when some rows are drafted (else
        :func:`_one_each`); for a drafted row, speculative decoding's verification: its picks
        while they equal its drafts, and one more.

        The pick after input ``t`` (the row's token, then draft ``t - 1``) is
        the model's own greedy token there; draft ``t`` is kept when it equals
        that pick, and the first pick that differs (or the one after the last
        draft) is the bonus token. So the tokens returned are exactly the
        picks a draft-free decode of the same forward would make. The row's
        cache keeps the keys of the inputs that led to them. A non-finite
        pick ends the row's tokens: first, it is the entry's error; after
        accepted picks, those are returned and the cache ends before the
        input that failed, so the next step recomputes it and the error comes
        there, as it would one token per step.

        ``scored`` (rows asking ``logprobs``): each returned token's entry is
        its own query's (the pick after the input before it), so they are the
        draft-free entries too.
        """
        j, lengths = 0, self.kv_cache.lengths
        while j < len(out_index):
            i = out_index[j]
            spec = self._drafts.get(i)
            drafts = () if spec is None else spec.tokens
            got, first = picks[j:j + len(drafts) + 1], j
            j += len(drafts) + 1
            accepted, finite = [], True
            for t, tok in enumerate(got):
                if type(tok) is not int:  # non-finite after input t
                    finite = False
                    break
                accepted.append(tok)
                if t == len(drafts) or tok != drafts[t]:
                    break
            if accepted:
                out.tokens[i] = accepted[0]
                if len(accepted) > 1:
                    out.more[i] = accepted[1:]
                if scored is not None and batch[i].logprobs is not None:
                    out.logprobs[i] = scored[first:first + len(accepted)]
            else:
                out.errors[i] = got[0]
            if spec is not None:
                lengths[spec.row] = spec.pos + max(len(accepted), 1)
                if self.draft_costs is not None and finite:
                    self.draft_costs.record_drafts(self._matched[i], len(drafts), len(accepted) - 1)

    def forward_batch(self, batch: Sequence[SlotInput], greedy_only: bool = False,
                      chunks: dict[int, int] | None = None) -> tuple[torch.Tensor | None, list[int]]:
        """The model part of :meth:`step`: ``(logits [n, vocab] fp32, batch index of each row)``.

        Rows come for the entries that get a token this iteration (a drafted
        row: one per query); None when none does. Advances the cache like
        :meth:`step` (for tests and benchmarks). ``chunks``: the plan's
        (:attr:`BatchPlan.chunks`), None: every prompt whole.
        ``greedy_only``: a plain greedy entry's row (``SamplingParams.is_plain_greedy``: no bias,
        no penalty, so its token is the argmax of its raw logits) may be exact only where its
        argmax can be (``-inf`` elsewhere; the weights' screened head, fp32 on CPU); every other
        row gets the full head.
        """
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("bind_slots() must be called before step()")
        decode, prefill = {}, {}
        for i, item in enumerate(batch):
            row = self._rows.row(item.slot)
            cached = cache.lengths[row]
            new = len(item.tokens) - cached
            fresh = cached == 0 or new < 1
            if fresh:  # a new occupant (or tokens the cache does not match)
                cache.clear(row)
                self._failed[row] = 0
                self._lookup.reset(row)
                cached, new = 0, len(item.tokens)
                if self.prefix_cache is not None:
                    self._seqs[row] = item.tokens  # stored at release; its cached prefix is loaded in _chunks
            if new == 1:
                decode[row] = i
            else:
                prefill[i] = _Prefill(fresh, row, cached)
        self._drafts = self._propose(batch, decode) if self.speculative_tokens and self._graphs is None else {}
        chunks = self._chunks(batch, prefill, chunks)
        self._query_rows = len(decode) + sum(len(d.tokens) for d in self._drafts.values())
        # the step's shape, for the thread tuner (steps of one shape cost alike): decode rows rounded up to
        # a power of two (a decode step streams the same weights for 7 rows as for 8), prompt tokens, drafts
        self._shape = (1 << (len(decode) - 1).bit_length() if decode else 0, sum(c.count for c in chunks),
                       sum(len(d.tokens) for d in self._drafts.values()))
        tuner = self.thread_tuner
        if tuner is not None:  # told the shape first: its probes compare steps of one shape (threads.py)
            n = tuner.next_threads(self._shape)
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
            self._step_start = time.perf_counter()
        self._prompt_logits, self._prompt_spans = None, ()
        with torch.inference_mode():
            result = self._run(batch, decode, chunks, greedy_only)
            if self.prefix_cache is not None:
                for c in chunks:  # its prompt's full blocks, for requests arriving while it runs
                    self._store(c.row, batch[c.index].tokens)
            return result

    # -- internals ---------------------------------------------------------

    def _store(self, row: int, tokens) -> None:
        """The row's full blocks into the prefix cache, unless a token of it went non-finite."""
        if tokens and not self._failed[row].item():
            self.prefix_cache.store(row, tokens)

    def _propose(self, batch, decode: dict[int, int]) -> dict[int, Draft]:
        """Draft tokens for the plain greedy decode rows (``SamplingParams.is_plain_greedy``), by batch index.

        A row with a logits processor gets none: its pick is not the argmax
        the drafts are checked against, and its penalties would have to count
        each earlier draft; prompt lookup drafts repeats of the row's own
        n-grams, which are what the penalties push down (see the module docstring).

        At most ``speculative_tokens`` each, and none past ``max_seq_len - 2``
        (the last position is the cache's scratch position)."""
        k, limit, drafts, lengths = self.speculative_tokens, self.max_seq_len - 2, {}, self.kv_cache.lengths
        self._matched = {}
        for row, i in decode.items():
            item = batch[i]
            pos = lengths[row]  # the row's token is at pos; its drafts would go to pos + 1 ..
            room = min(k, limit - pos)
            if room > 0 and item.sampling.is_plain_greedy:
                tokens = self._lookup.propose(row, item.tokens, room)
                if tokens:
                    drafts[i] = Draft(row, pos, tokens)
                    self._matched[i] = self._lookup.matched
        if self.draft_costs is not None and drafts:
            kept = self.draft_costs.choose({i: (self._matched[i], d.tokens) for i, d in drafts.items()}, len(decode))
            drafts = {i: d._replace(tokens=d.tokens[:kept[i]]) for i, d in drafts.items() if i in kept}
        return drafts

    def _chunks(self, batch, prefill: dict[int, _Prefill], planned: dict[int, int] | None) -> list[Chunk]:
        """This iteration's prompt chunks: the plan's, in its order (``planned`` None: each entry of
        ``prefill`` whole, prompts already started first), each from where its row's cache ends.

        A new prompt first reuses its longest cached prefix (:mod:`worker.models.llama.prefix_cache`),
        looked up when it gets its first chunk, not when admitted: prompts admitted together then
        hit the blocks the first one's chunks stored meanwhile; its chunk then starts after that
        prefix. The prompt tokens reused go to ``self._cached`` (batch index -> count, 0 for a
        miss; the entry's ``StepOutput.cached_tokens``)."""
        if planned is None:
            planned = {i: len(batch[i].tokens) for i in sorted(prefill, key=lambda i: (prefill[i].fresh, i))}
        chunks, self._cached, prefixes = [], {}, self.prefix_cache
        for i, count in planned.items():
            if not count or i not in prefill:  # (waits; or a one-token prompt: it decodes)
                continue
            fresh, row, start = prefill[i]
            item = batch[i]
            if fresh and prefixes is not None:
                if not skips_cache(item):
                    start = prefixes.load(row, item.tokens)
                self._cached[i] = min(start, item.prompt_len)  # (a resumed request's own tokens are not prompt)
            chunks.append(Chunk(i, row, start, min(len(item.tokens) - start, count)))
        return chunks

    def _run(self, batch, decode: dict[int, int], chunks: list[Chunk], greedy_only: bool = False
             ) -> tuple[torch.Tensor | None, list[int]]:
        """Build the step plan(s), run them; return logits and the batch index of each logits row."""
        cache = self.kv_cache
        # checks the length limit; a cache with a capacity_step (not the default) also makes room for
        # whole prompts at their first chunk: it grows once for a long prompt, while it is still
        # short, not once per step with ever larger copies (each growth copies every row)
        longest = max([cache.lengths[r] + 1 for r in decode] + [len(batch[c.index].tokens) for c in chunks]
                      + [d.pos + 1 + len(d.tokens) for d in self._drafts.values()], default=0)
        cache.reserve(longest)
        if self._graphs is not None:  # CUDA: prefill eagerly, decode from a graph
            parts = []
            if chunks:
                parts.append(self._forward(batch, {}, chunks))
            if decode:
                step = self._graphs.run(batch, decode, cache)
                self._note_failed(step.rows, step.failed)
                parts.append((step.logits, step.index))
            logits = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0] if parts else None
            return logits, [i for p in parts for i in p[1]]
        if not decode and not chunks:
            return None, []
        return self._forward(batch, decode, chunks, greedy_only)

    def _forward(self, batch, decode: dict[int, int], chunks: list[Chunk], greedy_only: bool = False
                 ) -> tuple[torch.Tensor, list[int]]:
        """One eager forward of ``decode`` and ``chunks`` (see :meth:`_run`)."""
        cache, device = self.kv_cache, self.device
        queries = 1 + max((len(d.tokens) for d in self._drafts.values()), default=0)
        inputs = decode_inputs(batch, decode, cache, self._drafts, queries)
        n_decode = len(inputs.ids)
        prefill = add_prefill(inputs, batch, chunks, cache)
        scoring = inputs.score_rows
        # the screened head only for a plain greedy row that wants no logprobs (they need the full head)
        greedy = ([batch[i].sampling.is_plain_greedy and batch[i].logprobs is None for i in inputs.out_index]
                  + [False] * len(scoring) if greedy_only and self.weights.greedy_head is not None else None)
        plan = step_plan(inputs, n_decode, prefill, queries, greedy, device)
        with _attention_kernels(device):
            logits, failed = forward(self.weights, cache.kv, plan)
        if queries > 1:  # a draft token's failure counts only if it is accepted (then its pick says so)
            failed[[e for e, at in enumerate(inputs.slots) if at % queries]] = False
        self._note_failed(plan.write_rows, failed)
        if scoring:  # prompt_logprobs' rows (after the rows that give tokens): step() scores them
            n_out = len(inputs.out_index)
            self._prompt_logits, self._prompt_spans = logits[n_out:], inputs.score_spans
            logits = logits[:n_out]
        return logits, inputs.out_index

    def _note_failed(self, rows: torch.Tensor, failed: torch.Tensor) -> None:
        """Remember the rows of non-finite tokens (padding entries are never non-finite)."""
        self._failed.index_add_(0, rows, failed.to(torch.int32))


def _one_each(out: StepOutput, out_index: list[int], picks: list, scored: list | None,
              batch: Sequence[SlotInput]) -> None:
    """Each logits row's pick into ``out`` (no row drafted: one pick per row, the entry's token
    or, non-finite, its error), with its logprobs entry where the row asks."""
    for j, (i, tok) in enumerate(zip(out_index, picks)):
        if type(tok) is int:
            out.tokens[i] = tok
            if scored is not None and batch[i].logprobs is not None:
                out.logprobs[i] = [scored[j]]
        else:
            out.errors[i] = tok


def _attention_kernels(device: str):
    """On CUDA, SDPA may use flash or memory-efficient attention (or math), never cuDNN,
    whose plans are rebuilt for every new shape (issue 8: 2.1 ms of CPU per call)."""
    if device == "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
