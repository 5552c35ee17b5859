"""bench/gpu.py -- random-weight serving bench on a device: ``bench/model.py --random-weights``.

The method of the GPU measurement in issue 8 (shared/bench/gpu_serving.py),
made a part of bench/model.py. Weights are random with the shapes of real
models, because a GPU machine may not reach a model hub and throughput does
not depend on weight values; stop tokens are off, so every request generates
exactly its length and every system does the same work. Three systems on the
same device, weights and workload, one at a time (bench/systems.py's, as bench/model.py's):

- ``slotserve``: the in-process :class:`worker.BatchInferenceEngine` on the
  model :func:`slotserve_model` loads (``--slots`` slots), after a warm-up
  that fills every slot once;
- ``hf-static``: ``model.generate`` on left-padded batches of ``slots``
  requests in order, each batch running to its longest request (what a user
  gets from static batching: a request's extra tokens are wasted);
- ``hf-cb``: transformers' continuous batching manager
  (``init_continuous_batching``), ``slots`` requests per batch; on CUDA its
  paged cache is sized by transformers from free memory.

Cases (the issue's table): SmolLM2-135M shape, HE32 at 8 slots in fp32 and
bf16; 256 requests with lengths U[16, 256] (``random.Random(1)``, prompts the
HE32 prompts cycled) at 64 slots in bf16, for the SmolLM2-135M and
Llama-3.2-1B shapes (the 1B's llama3 RoPE scaling is left out: it changes
no shape or cost). Issue 24 adds the Qwen2.5-0.5B shape (q/k/v biases, tied
head) and the Gemma-2-2B shape (GeGLU, sandwich norms, soft-capping,
alternating 4,096-token windows: longer than any sequence here, so every
layer attends to all of it; 256-dim heads; transformers' eager attention,
as Gemma 2 has no SDPA path there), each written as its transformers config
class (:data:`SHAPES`): the 256-request mix at 64 slots in bf16 on a GPU, and
on a CPU ``he8`` (HE32's first 8 prompts and lengths, one batch of 8 slots)
in bf16, since a 2-core CPU takes ~10 minutes per system for HE32 on a 2B
model. :func:`cases_for` picks the cases of a device (``Case.devices``). HE32 is bench/model.py's: the first 32 HumanEval prompts
as SmolLM2 token ids, each generating its bench/model.py ``max_tokens``
(:func:`bench.common.he32`); the issue's table used the greedy answer
lengths instead (1,958 tokens instead of 2,348), so its HE32 rows compare
in tokens/s, not in wall time.

``--tiny`` (for CPU, and tests): 2-layer 64-wide models with a 1,024-token
vocabulary, and scaled workloads -- 8 synthetic prompts (8-24 tokens,
``random.Random(2)``) for HE32, 32 for the 256-request mix, lengths a
tenth (at least 2). It checks the plumbing, not speed.

A budget (``--time-limit-s``, default 170 s, counted from the first case)
skips whatever would start after it, marked ``skipped``; what runs when it
expires finishes, so the whole run stays within 4 minutes as long as no
single system takes over a minute (the issue's slowest, slotserve on the
SmolLM2 256-request case at 652 tokens/s, took ~53 s). The cases run in
the order of :data:`CASES`: the issue's targets first.
Writes ``model_random_<device>[_tiny].json`` and ``.png`` in ``--out``.
GPU numbers from this file were not verified on a GPU by its author (no GPU
machine was at hand; the Qwen2.5 and Gemma 2 cases neither); the tiny CPU
mode runs every case and is tested.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import systems
from bench.common import machine_record, write_results
from bench.systems import Run, free

_LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
SHAPES = {
    # config.json of HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    # config.json of meta-llama/Llama-3.2-1B (head_dim 64), without its llama3 rope_scaling
    "llama-3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    # config.json of Qwen/Qwen2.5-0.5B (Qwen2ForCausalLM: q/k/v biases; no sliding window in use)
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                         bos_token_id=151643, eos_token_id=151643),
    # config.json of google/gemma-2-2b (Gemma2ForCausalLM)
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                       rope_theta=10000.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
                       pad_token_id=0),
}
"""Shape name -> its transformers config (``model_type`` picks the class, ``AutoConfig.for_model``),
random weights with seed 0; ``max_position_embeddings`` is :data:`MAX_CONTEXT` for every shape."""
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024)
TINY_HEAD = {"gemma2": dict(head_dim=16, query_pre_attn_scalar=16)}  # explicit head sizes of a family, made tiny
HF_ATTENTION = {"gemma2": "eager"}  # transformers' Gemma 2 has no SDPA path; other families: "sdpa"
MAX_CONTEXT = 2048  # prompts are <= ~500 tokens, lengths <= 256


@dataclass(frozen=True)
class Case:
    """One row of the issue's table."""

    name: str
    shape: str  # key of SHAPES
    dtype: str  # "float32" or "bfloat16"
    workload: str  # "he32", "he8" (HE32's first 8) or "mix256"
    slots: int
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on (--tiny: all cases on any device)


CASES = (  # the targets first (bf16, 256 requests, 64 slots): a time limit skips the HE32 rows first
    Case("smol-bf16-mix256-64", "smollm2-135m", "bfloat16", "mix256", 64),
    Case("1b-bf16-mix256-64", "llama-3.2-1b", "bfloat16", "mix256", 64),
    Case("qwen2.5-bf16-mix256-64", "qwen2.5-0.5b", "bfloat16", "mix256", 64, ("cuda",)),
    Case("gemma2-bf16-mix256-64", "gemma-2-2b", "bfloat16", "mix256", 64, ("cuda",)),
    Case("smol-fp32-he32-8", "smollm2-135m", "float32", "he32", 8),
    Case("smol-bf16-he32-8", "smollm2-135m", "bfloat16", "he32", 8),
    Case("qwen2.5-bf16-he8-8", "qwen2.5-0.5b", "bfloat16", "he8", 8, ("cpu",)),
    Case("gemma2-bf16-he8-8", "gemma-2-2b", "bfloat16", "he8", 8, ("cpu",)),
)


def cases_for(device: str, shapes=None, tiny: bool = False) -> tuple[Case, ...]:
    """The cases of :data:`CASES` that run on ``device`` (all of them with ``tiny``), of ``shapes``
    only when given (names of :data:`SHAPES`; ValueError for another)."""
    unknown = set(shapes or ()) - set(SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    kind = torch.device(device).type
    return tuple(c for c in CASES if (tiny or kind in c.devices) and (not shapes or c.shape in shapes))
SYSTEMS = ("slotserve", "hf-static", "hf-cb")


def summary(run: Run) -> dict:
    """One system's row of a case (times rounded to 1 ms)."""
    useful = sum(len(o) for o in run.outputs)
    return {"system": run.name, "wall_s": round(run.wall_s, 3), "useful_tokens": useful,
            "tokens_per_s": round(useful / run.wall_s, 1),
            "ttft_mean_ms": round(1000 * sum(run.first_s) / len(run.first_s), 1) if run.first_s else None,
            "note": run.note}


# ---------------------------------------------------------------- weights and workloads


def shape_config(shape: str, tiny: bool):
    """The transformers config of ``shape`` (:data:`SHAPES`; ``tiny``: :data:`TINY` sizes)."""
    from transformers import AutoConfig

    params = dict(SHAPES[shape])
    model_type = params.pop("model_type")
    if tiny:
        params.update(TINY, **TINY_HEAD.get(model_type, {}))
    return AutoConfig.for_model(model_type, **params, max_position_embeddings=MAX_CONTEXT)


def model_dir(shape: str, dtype: str, tiny: bool, device: str) -> str:
    """A ``save_pretrained`` directory of a random-weight model with ``shape`` (seed 0), cached in the temp dir."""
    from transformers import AutoModelForCausalLM

    path = Path(tempfile.gettempdir()) / "slotserve-bench-random" / f"{shape}-{dtype}{'-tiny' if tiny else ''}"
    if not (path / "config.json").exists():
        cfg = shape_config(shape, tiny)
        torch.manual_seed(0)
        with torch.device(device):  # random init is the slow part for 1B; do it where the work is
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        model.save_pretrained(path)
        del model
        free(device)
    return str(path)


def workload(kind: str, tiny: bool, he_prompts, he_lengths) -> tuple[list[list[int]], list[int]]:
    """``(prompts, lengths)`` of a case's workload (see the module docstring)."""
    if tiny:
        rng = random.Random(2)
        base = [[rng.randrange(3, 1000) for _ in range(rng.randint(8, 24))] for _ in range(8)]
        n = 32 if kind == "mix256" else 8
        prompts = [base[i % len(base)] for i in range(n)]
        if kind != "mix256":
            return prompts, [max(2, m // 10) for m in he_lengths[:n]]
        rng = random.Random(1)
        return prompts, [rng.randint(2, 25) for _ in range(n)]
    if kind in ("he32", "he8"):
        n = 8 if kind == "he8" else len(he_prompts)
        return [list(p) for p in he_prompts[:n]], list(he_lengths[:n])
    rng = random.Random(1)
    return [list(he_prompts[i % len(he_prompts)]) for i in range(256)], [rng.randint(16, 256) for _ in range(256)]


# ---------------------------------------------------------------- systems (bench/systems.py)


@contextlib.contextmanager
def slotserve_model(path: str, *, device: str, dtype: str):
    """slotserve's model runner on ``device``, for the duration of the ``with`` block.

    The one place that says how slotserve is put on a device: ``load_model``'s
    ``device`` and ``precision`` (Llama shapes run on slotserve's own runner,
    CUDA graphs on a GPU).
    """
    from worker.models import load_model

    precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    yield load_model(path, device=device, precision=precision, max_cache_len=MAX_CONTEXT)


def run_slotserve(path, dtype, device, prompts, lengths, slots) -> Run:
    with slotserve_model(path, device=device, dtype=dtype) as model:
        return systems.slotserve(model, prompts, lengths, slots, device=device)


def _hf_model(path, dtype, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    attention = HF_ATTENTION.get(AutoConfig.from_pretrained(path).model_type, "sdpa")
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                attn_implementation=attention).to(device).eval()


def run_hf_static(path, dtype, device, prompts, lengths, slots) -> Run:
    model = _hf_model(path, dtype, device)
    try:  # stops off; a warm-up batch first; no per-step streamer (a host sync per step on a GPU)
        return systems.hf_static(model, prompts, lengths, slots, device=device, warmup=True, step_times=False)
    finally:
        del model


def run_hf_cb(path, dtype, device, prompts, lengths, slots) -> Run:
    model = _hf_model(path, dtype, device)
    try:  # stops off; one warm-up request; no timestamps
        return systems.hf_cb(model, prompts, lengths, slots, config=systems.cb_config(prompts, lengths, slots, device),
                             warm="request", timestamps=False)
    finally:
        del model


RUNNERS = {"slotserve": run_slotserve, "hf-static": run_hf_static, "hf-cb": run_hf_cb}


# ---------------------------------------------------------------- the run


def run_cases(*, device: str, tiny: bool, he_prompts, he_lengths, systems=SYSTEMS, cases=None,
              time_limit_s: float = 170.0, log=print) -> dict:
    """Every case x system; returns the JSON payload (see :func:`main`). A system that raises
    is recorded with its error and the run goes on."""
    cases = cases_for(device, tiny=tiny) if cases is None else cases
    t_start = time.monotonic()
    payload = {"mode": "random-weights", "device": device, "tiny": tiny, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "time_limit_s": time_limit_s, "cases": []}
    import transformers

    payload["transformers"] = transformers.__version__
    transformers.utils.logging.disable_progress_bar()  # one bar per model load drowns the log
    if torch.device(device).type == "cuda":
        payload["gpu"] = torch.cuda.get_device_name(0)
    payload["machine"] = machine_record()  # the results format's record (bench.common), written by report()
    for case in cases:
        path = model_dir(case.shape, case.dtype, tiny, device)
        prompts, lengths = workload(case.workload, tiny, he_prompts, he_lengths)
        row = {"case": case.name, "shape": case.shape, "model_type": SHAPES[case.shape]["model_type"],
               "dtype": case.dtype, "workload": case.workload,
               "slots": case.slots, "requests": len(prompts), "tokens_asked": sum(lengths), "systems": []}
        outputs = {}
        for name in systems:
            if time.monotonic() - t_start > time_limit_s:
                row["systems"].append({"system": name, "skipped": f"time limit {time_limit_s:.0f} s reached"})
                continue
            try:
                result = RUNNERS[name](path, case.dtype, device, prompts, lengths, case.slots)
            except Exception:  # noqa: BLE001 - one system's failure is a result, the bench goes on
                row["systems"].append({"system": name, "error": traceback.format_exc()[-2000:]})
                log(f"{case.name} {name}: ERROR\n{row['systems'][-1]['error']}")
                continue
            finally:
                free(device)
            line = summary(result)
            line["exact_lengths"] = [len(o) for o in result.outputs] == lengths
            row["systems"].append(line)
            outputs[name] = result.outputs
            log(f"{case.name} {name}: {result.wall_s:.2f} s, {line['tokens_per_s']} tokens/s")
        speed = {s["system"]: s["tokens_per_s"] for s in row["systems"] if "tokens_per_s" in s}
        if "slotserve" in speed:
            row["slotserve_vs"] = {b: round(speed["slotserve"] / speed[b], 3) for b in speed if b != "slotserve"}
            row["identical_to_slotserve"] = {b: sum(a == c for a, c in zip(outputs["slotserve"], outputs[b]))
                                             for b in outputs if b != "slotserve"}
        payload["cases"].append(row)
    payload["total_s"] = round(time.monotonic() - t_start, 1)
    return payload


def report(payload: dict, out: Path) -> Path:
    """Print the table; write ``model_random_<device>[_tiny].json`` and ``.png`` in ``out``; return the JSON path."""
    print(f"\n{'case':>22} | {'system':>10} | {'wall_s':>8} | {'tokens/s':>9} | {'ttft ms':>8} | vs")
    for row in payload["cases"]:
        for s in row["systems"]:
            ratio = row.get("slotserve_vs", {}).get(s["system"])
            cells = [s.get("wall_s", s.get("skipped", "error")), s.get("tokens_per_s", "-"), s.get("ttft_mean_ms")]
            print(f"{row['case']:>22} | {s['system']:>10} | " + " | ".join(f"{str(c):>8}" for c in cells)
                  + (f" | slotserve {ratio:.2f}x" if ratio else ""))
    print(f"total {payload['total_s']} s")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"model_random_{torch.device(payload['device']).type}{'_tiny' if payload['tiny'] else ''}"
    rest = dict(payload)
    machine = rest.pop("machine")
    path = write_results(out / f"{stem}.json", rest, machine)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(SYSTEMS)
    for k, name in enumerate(SYSTEMS):
        ys = [next((s.get("tokens_per_s", 0) for s in row["systems"] if s["system"] == name), 0)
              for row in payload["cases"]]
        ax.bar([i + k * width for i in range(len(ys))], ys, width, label=name)
    ax.set_xticks([i + width for i in range(len(payload["cases"]))], [r["case"] for r in payload["cases"]])
    ax.set_ylabel("useful output tokens/s")
    ax.set_title(f"random weights on {payload.get('gpu', payload['device'])}{' (tiny)' if payload['tiny'] else ''}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    plt.close(fig)
    print(f"wrote {path} and {stem}.png")
    return path
