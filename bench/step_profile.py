"""bench/step_profile.py -- where a decode step's time goes (issue 32, item 1).

One batched decode step of slotserve's Llama runner (:class:`~worker.models.llama.runner.LlamaRunner`)
at 1, 8 and 32 slots, each slot holding ``--context`` (160) cached tokens, per precision
(``fp32``, ``bf16``, ``gguf``: the GGUF file's own block-quantised weights, where the GGUF kernel
runs; ``gguf-int8`` / ``gguf-bf16``: with that ``--gguf-activations``) and thread count, split into:

- ``linear``: the decoder layers' products (q/k/v, o, gate/up, down), whatever kernel runs them;
- ``head``: the LM head (the screened head's bf16 screen and exact rows at fp32);
- ``attention``: the decode attention, its per-iteration views and masks included (the compiled
  one stores the new keys and values too: its KV write is counted here);
- ``kv write``: storing the new keys and values in the cache (``index_put_``);
- ``norm/rope/act``: the elementwise operations (RMSNorm, RoPE, the MLP's activation, residual adds);
- ``other ops``: every other operation of the step (embedding, views, slicing, casts, the plan's tensors);
- ``sampling``: the sampler call (:meth:`LlamaRunner._pick`);
- ``python``: the rest: Python and dispatch between operations (the step's time in no operation).

How: the step runs under ``torch.profiler`` with record_function scopes around the linears,
the attention functions and the sampler (wrappers installed for the measurement only); a
scope's share is its whole time (Python inside it included; a pybind kernel such as the GGUF
kernel is no profiler op, so only a scope sees it), an unscoped operation counts under its
category by name, and ``python`` is what is left of the steps' time. The profiler slows each
operation a little (~1-2 us), so the table gives each category's share of the profiled
steps, applied to the median of ``--steps`` unprofiled steps (``step ms``), and the operations
per step. Thread synchronisation is inside each operation's time (compare ``--threads 1,2``).

``--attention fused,batched`` compares decode-attention implementations in the same run: their
steps of a case are timed in turns (:data:`ATTENTION`; default: the runner's own).

Usage: ``python -m bench.step_profile [--precisions fp32,bf16,gguf] [--slots 1,8,32] [--threads 1,2]
[--attention ...] [--out bench/results/step_profile.json]``. Prints one table per
(attention, precision) and writes the JSON (the results format of bench/common.py; each
case's load average before/after and its top operations by self time).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.common import RESULTS, he32, load_avg, machine_record, write_results  # noqa: E402

CATEGORIES = ("linear", "head", "attention", "kv write", "norm/rope/act", "other ops", "sampling", "python")
"""The columns of the table, in order (see the module docstring)."""

ELEMENTWISE = {"aten::" + n for n in (
    "mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "rsqrt", "sum", "mean", "pow", "silu", "silu_",
    "gelu", "gelu_", "tanh", "tanh_", "nan_to_num_", "nan_to_num", "rms_norm", "neg", "exp", "isfinite", "all",
    "bitwise_not", "logical_not", "where", "abs", "eq", "ne")}
"""Operations counted as ``norm/rope/act`` outside the scopes."""
KV_WRITES = {"aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::index_copy_"}
"""Operations counted as ``kv write`` outside the scopes."""

_SCOPE = "ss/"


class _Scoped:
    """A linear (or head) run inside a profiler scope; everything else passes through."""

    def __init__(self, inner, name: str) -> None:
        self._inner, self._name = inner, _SCOPE + name

    def __call__(self, x):
        with record_function(self._name):
            return self._inner(x)

    def add(self, residual, x):
        with record_function(self._name):
            return self._inner.add(residual, x)

    def greedy_logits(self, x):
        with record_function(self._name):
            return self._inner.greedy_logits(x)

    def decode_attention(self, *args):  # the compiled decode attention (with its KV write)
        with record_function(self._name):
            return self._inner.decode_attention(*args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _scoped_fn(fn, name: str):
    def run(*args, **kwargs):
        with record_function(_SCOPE + name):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def scopes(runner):
    """Install the profiler scopes on ``runner`` (its weights' linears, the attention functions of
    :mod:`worker.models.llama.model`, its sampler call); removed on exit."""
    from worker.models.llama import model as forward_module

    w = runner.weights
    saved_layers = [(lw.qkv, lw.o, lw.gate_up, lw.down) for lw in w.layers]
    saved_heads = (w.head, w.greedy_head, w.attention_kernel)
    saved_fns = {n: getattr(forward_module, n) for n in ("decode_attention", "prefill_attention", "decode_views")}
    try:
        for lw in w.layers:
            lw.qkv, lw.o, lw.gate_up, lw.down = (_Scoped(x, "linear") for x in (lw.qkv, lw.o, lw.gate_up, lw.down))
        w.head = _Scoped(w.head, "head")
        if w.attention_kernel is not None:
            w.attention_kernel = _Scoped(w.attention_kernel, "attention")
        if w.greedy_head is not None:
            w.greedy_head = _Scoped(w.greedy_head, "head")
        for n, fn in saved_fns.items():
            setattr(forward_module, n, _scoped_fn(fn, "attention"))
        runner._pick = _scoped_fn(runner._pick, "sampling")
        yield
    finally:
        for lw, parts in zip(w.layers, saved_layers):
            lw.qkv, lw.o, lw.gate_up, lw.down = parts
        w.head, w.greedy_head, w.attention_kernel = saved_heads
        for n, fn in saved_fns.items():
            setattr(forward_module, n, fn)
        del runner._pick


def split(events, steps: int) -> dict:
    """Per category the profiled milliseconds per step, the operations per step, and the top
    operations by self time, from the profiler's ``events()`` of ``steps`` steps each inside an
    ``ss/step`` scope."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    step_us, ops, self_us = 0.0, 0, {}
    for e in events:
        self_us[e.name] = self_us.get(e.name, 0.0) + e.self_cpu_time_total
        if e.name == _SCOPE + "step":
            step_us += e.cpu_time_total
            continue
        parent, scope, nested = e.cpu_parent, None, False
        while parent is not None:
            if parent.name.startswith(_SCOPE) and parent.name != _SCOPE + "step":
                scope = scope or parent.name
            elif not parent.name.startswith(_SCOPE):
                nested = True
            parent = parent.cpu_parent
        if e.name.startswith(_SCOPE):
            if scope is None:  # an outermost scope: all its time is its category's
                ms[e.name[len(_SCOPE):]] += e.cpu_time_total
            continue
        if nested:
            continue
        ops += 1
        if scope is None:
            cat = "kv write" if e.name in KV_WRITES else "norm/rope/act" if e.name in ELEMENTWISE else "other ops"
            ms[cat] += e.cpu_time_total
    ms["python"] = step_us - sum(ms.values())
    top = sorted(((n, us) for n, us in self_us.items() if not n.startswith(_SCOPE)), key=lambda x: -x[1])[:12]
    return {"profiled_step_ms": step_us / steps / 1000, "ms": {k: v / steps / 1000 for k, v in ms.items()},
            "ops_per_step": ops / steps, "top_self_ms": {n: round(us / steps / 1000, 3) for n, us in top}}


def prefilled(runner, prompts, slots: int, context: int) -> list:
    """Bind ``slots`` slots and prefill each with ``context`` tokens (HumanEval prompts, repeated);
    returns the SlotInputs, each with its first token appended."""
    from bench.model import prefill
    from worker.models.base import SlotInput

    runner.bind_slots(slots)
    inputs = [SlotInput(s, list((prompts[s % len(prompts)] * 8)[:context])) for s in range(slots)]
    prefill(runner, inputs)
    return inputs


def decode_step(runner, inputs) -> None:
    from worker.models.base import BatchPlan

    out = runner.step(BatchPlan(inputs, {}))
    for item, tok in zip(inputs, out.tokens):
        item.tokens.append(tok)


def measure(runner, prompts, slots: int, context: int, steps: int, profiled: int, impls: list) -> dict:
    """One case for each decode attention of ``impls`` (:data:`ATTENTION` names, None: as loaded):
    the median of ``steps`` unprofiled steps, taken in turns (one step of each implementation,
    then the next round: a load that changes meanwhile falls on all of them alike), and the
    profiled split of ``profiled`` steps each (see the module docstring). Returns impl -> result."""
    before = load_avg()
    inputs = prefilled(runner, prompts, slots, context)
    for impl in impls:
        with attention_impl(runner, impl):
            for _ in range(2):
                decode_step(runner, inputs)
    times = {impl: [] for impl in impls}
    for _ in range(steps):
        for impl in impls:
            with attention_impl(runner, impl):
                t = time.perf_counter()
                decode_step(runner, inputs)
                times[impl].append(time.perf_counter() - t)
    splits = {}
    for impl in impls:
        with attention_impl(runner, impl), scopes(runner), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profiled):
                with record_function(_SCOPE + "step"):
                    decode_step(runner, inputs)
        splits[impl] = split(prof.events(), profiled)
    for s in range(slots):
        runner.release_slot(s)
    after, results = load_avg(), {}
    for impl, out in splits.items():
        step_ms = 1000 * statistics.median(times[impl])
        shares = {k: v / out["profiled_step_ms"] for k, v in out["ms"].items()}
        results[impl] = {"step_ms": round(step_ms, 2), "min_step_ms": round(1000 * min(times[impl]), 2),
                         "profiled_step_ms": round(out["profiled_step_ms"], 2),
                         "share": {k: round(v, 4) for k, v in shares.items()},
                         "est_ms": {k: round(v * step_ms, 2) for k, v in shares.items()},
                         "ops_per_step": round(out["ops_per_step"]), "top_self_ms": out["top_self_ms"],
                         "load_avg_before_after": [before, after]}
    return results


def load(name: str, precision: str):
    """``precision``: fp32, bf16, gguf, or ``gguf-int8`` / ``gguf-bf16`` (gguf with that ``gguf_activations``)."""
    from worker.models import load_model

    precision, _, activations = precision.partition("-")
    return load_model(name, precision=precision, runner="slotserve", gguf_activations=activations or "auto")


ATTENTION = ("fused", "batched")
"""``--attention`` names: ``fused``, the compiled decode attention with the KV write
(:mod:`worker.models.llama.attnkernel`; the runner's default where it builds); ``batched``, the
batched products (``baddbmm``, ``softmax``, ``bmm``) after an indexed KV write."""


@contextlib.contextmanager
def attention_impl(runner, name: str | None):
    """Run ``runner``'s forward with decode attention ``name`` (:data:`ATTENTION`; None: as loaded)."""
    w = runner.weights
    saved = getattr(w, "attention_kernel", None)
    if name == "batched":
        w.attention_kernel = None
    elif name == "fused" and saved is None:
        raise ValueError("the compiled decode attention did not load here (worker.models.llama.attnkernel)")
    try:
        yield
    finally:
        if hasattr(w, "attention_kernel"):
            w.attention_kernel = saved


def table(rows: list[dict]) -> str:
    head = f"{'threads':>7} {'slots':>5} {'step ms':>8} {'ops':>5} " + " ".join(f"{c:>13}" for c in CATEGORIES) + "  load"
    lines = [head]
    for r in rows:
        m = r["result"]
        cells = " ".join(f"{m['est_ms'][c]:6.2f} {100 * m['share'][c]:4.0f}% " for c in CATEGORIES)
        lines.append(f"{r['threads']:>7} {r['slots']:>5} {m['step_ms']:>8.2f} {m['ops_per_step']:>5} {cells} "
                     f"{m['load_avg_before_after'][0]:.2f}-{m['load_avg_before_after'][1]:.2f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model alias or path (default smollm2-135m)")
    ap.add_argument("--precisions", default="fp32,bf16,gguf", help="comma-separated (default fp32,bf16,gguf)")
    ap.add_argument("--slots", default="1,8,32", help="slot counts, comma-separated (default 1,8,32)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated (default 1,2)")
    ap.add_argument("--context", type=int, default=160, help="cached tokens per slot (default 160)")
    ap.add_argument("--steps", type=int, default=12, help="unprofiled steps timed per case (default 12)")
    ap.add_argument("--profiled", type=int, default=6, help="profiled steps per case (default 6)")
    ap.add_argument("--attention", default="", help="decode attention implementations to compare, comma-separated "
                                                     "(default: the runner's own)")
    ap.add_argument("--out", type=Path, default=RESULTS / "step_profile.json")
    return ap


def main() -> None:
    args = parser().parse_args()
    machine = machine_record()
    impls = [a for a in args.attention.split(",") if a] or [None]
    rows = []
    prompts = None
    for precision in args.precisions.split(","):
        try:
            runner = load(args.model, precision)
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"{precision}: skipped ({exc})")
            continue
        runner.thread_tuner = None  # each row at its --threads count (the tuner would choose per step)
        if prompts is None:
            prompts = he32(runner.tokenizer)[0]
        print(f"{precision}: {runner.weights.linear_kind}", flush=True)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for slots in (int(s) for s in args.slots.split(",")):
                results = measure(runner, prompts, slots, args.context, args.steps, args.profiled, impls)
                for impl, result in results.items():
                    rows.append({"precision": precision, "attention": impl or "default", "threads": threads,
                                 "slots": slots, "result": result})
                    print(f"  {impl or 'default'} threads {threads} slots {slots}: {result['step_ms']} ms "
                          f"(load {result['load_avg_before_after']})", flush=True)
                save(args, rows, machine)  # after every case: a long run interrupted keeps what it measured
        del runner
    for precision in dict.fromkeys(r["precision"] for r in rows):
        for impl in dict.fromkeys(r["attention"] for r in rows):
            print(f"\n{precision}, decode attention {impl} (ms per step estimated from the profiled shares; "
                  f"{args.context} cached tokens per slot):")
            print(table([r for r in rows if r["precision"] == precision and r["attention"] == impl]))
    print(f"\nwrote {save(args, rows, machine)}")


def save(args, rows: list[dict], machine: dict) -> Path:
    payload = {"model": args.model, "context_tokens": args.context, "steps": args.steps, "profiled": args.profiled,
               "categories": list(CATEGORIES), "torch": torch.__version__, "rows": rows}
    return write_results(args.out, payload, machine)


if __name__ == "__main__":
    main()
