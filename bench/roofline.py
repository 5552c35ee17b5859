"""bench/roofline.py -- the ceilings of an exact fp32 SmolLM2-135M step on this CPU, and torch's kernels against them.

Issue 8 asks the exact fp32 mode for >= 4x HF static on HE32. Whether that
is reachable depends on two ceilings of the machine at hand, measured here
on random weights with SmolLM2-135M's shapes (bench/gpu.py ``SHAPES``):

- ``read_gb_s``: streaming read bandwidth, ``Tensor.sum`` over the 30
  layers' fp32 weights (120 distinct tensors, 425 MB: no cache holds them);
- ``fp32_gemm_gflop_s``: the fastest fp32 linear kind at 512 rows over the
  same weights (compute-bound);

and, per CPU linear kind this torch runs (``dense``, ``mkl``, ``onednn``;
bf16 ``onednn`` for reference), the 30 layers' four linears (qkv, o,
gate-up, down) at ``--rows`` rows: milliseconds, and the read bandwidth that
time would mean if the step only read weights (``implied_gb_s``; the
kernels' efficiency against ``read_gb_s``).

From them, a floor for HE32 in exact fp32 (``he32_floor``), the roofline
model (Williams, Waterman & Patterson, CACM 2009): prefill at the GEMM peak
(its FLOPs: ``2 x`` parameters per token, plus causal attention), and each
decode step ``max(bytes / read bandwidth, FLOPs / peak)`` with bytes =
layer weights + fp32 LM head + the KV cache at the mean context, ``slots``
rows a step, ``(output - requests) / slots`` steps (a request's first token
comes from its prefill). It counts no elementwise work, no attention
inefficiency and no Python: a real step cannot be faster. HE32's sizes are
flags (defaults: bench/model.py's HE32 on SmolLM2's tokenizer, 3,200 prompt
tokens, 1,958 greedy output tokens in 32 requests, 8 slots: :func:`bench.common.he32`'s prompts
on SmolLM2's tokenizer and their greedy lengths).

Any model's decode-step memory floor (``--models``): one step reads every
weight once (the token embedding only by rows, so not counted; a tied LM
head reads it whole), so it cannot take less than ``bytes of weights /
bandwidth`` (:func:`decode_floor_ms`). Bytes per precision
(:func:`step_weight_bytes`, from the GGUF header alone): ``fp32`` 4 a
parameter, ``bf16`` 2, ``int8`` 1 and ``int4`` 1/2 (scales not counted),
``gguf`` the tensors as the file stores them (Q4_K_M: ~4.8 bits a weight;
also llama.cpp's). Bandwidth (:func:`stream_bandwidth`): one large fp32
tensor summed (read) and copied (read + write) in torch, the fastest of a
few passes, at ``--threads``.

The int8 compute floor of the same step (:func:`int8_peak`, :func:`step_macs`,
:func:`compute_floor_ms`): the CPU's int8 multiply-add instruction (AVX-512
VNNI's ``vpdpbusd``, else AVX2's ``vpmaddubsw`` + ``vpaddw``, the pair the
AVX2 product's 4-bit loop issues) timed on ``--threads`` threads in a probe
compiled from ``bench/int8_peak.c``, and a ``gguf`` step's products at
``--slots`` rows at that rate: the least time a quantized product with int8
activations could take here, whatever its scales cost. A step at many rows
is compute-bound where this exceeds its memory floor.

``--tiny``: 2 small layers and few passes, to test the plumbing, not speed.
Writes ``roofline[_tiny].json`` in ``--out``.

    python -m bench.roofline [--threads 2] [--rows 1,8,24] [--tiny]
        [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --precisions fp32,bf16,gguf]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import RESULTS, machine_record, write_results
from bench.gpu import SHAPES, TINY
from worker.models.llama.linear import cpu_linear_candidates, make_linear
from worker.models.llama.weights import LlamaShape


def layer_shapes(cfg: dict) -> tuple[tuple[int, int], ...]:
    """``(out, in)`` of one layer's fused linears: qkv, o, gate-up, down, as the runner fuses them
    (:attr:`worker.models.llama.weights.LlamaShape.linear_shapes`)."""
    return LlamaShape.of(SimpleNamespace(**{"rms_norm_eps": 1e-5, **cfg}), context=0).linear_shapes


def best_ms(fn, passes: int) -> float:
    """Fastest of ``passes`` timed calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def measure(cfg: dict, rows: list[int], passes: int) -> dict:
    """Read bandwidth, the fp32 GEMM peak and each kind's layer times (see module docstring)."""
    shapes = layer_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes] for _ in range(cfg["num_hidden_layers"])]
    nbytes = sum(w.nbytes for layer in weights for w in layer)
    params = nbytes // 4
    out = {"layer_weight_mb": round(nbytes / 2**20, 1)}
    with torch.inference_mode():
        read_ms = best_ms(lambda: [w.sum() for layer in weights for w in layer], passes)
        out["read_gb_s"] = round(nbytes / read_ms / 1e6, 1)
        kinds = {}
        for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            for kind in cpu_linear_candidates(dtype):
                if dtype == torch.bfloat16 and kind != "onednn":
                    continue
                name = kind if dtype == torch.float32 else f"bf16-{kind}"
                linears = [[make_linear(w, None, precision, "cpu", kind) for w in layer] for layer in weights]
                times = {}
                for m in rows + ([512] if dtype == torch.float32 else []):
                    xs = [torch.randn(m, k, generator=gen) for _, k in shapes]
                    times[m] = best_ms(lambda: [lin(x) for layer in linears for lin, x in zip(layer, xs)],
                                       passes if m < 512 else max(2, passes // 3))
                kinds[name] = {
                    "ms": {str(m): round(t, 2) for m, t in times.items()},
                    "implied_gb_s": {str(m): round(nbytes * (2 if dtype == torch.bfloat16 else 4) / 4 / t / 1e6, 1)
                                     for m, t in times.items() if m < 512},
                }
                if 512 in times:
                    kinds[name]["gflop_s_512"] = round(2 * 512 * params / times[512] / 1e6, 1)
                del linears
        out["kinds"] = kinds
        out["fp32_gemm_gflop_s"] = max(k["gflop_s_512"] for k in kinds.values() if "gflop_s_512" in k)
    return out


def he32_floor(cfg: dict, read_gb_s: float, gflop_s: float, prompt_tokens: int, output_tokens: int,
               requests: int, slots: int) -> dict:
    """The roofline floor of the workload in exact fp32 (see module docstring); seconds and ms."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], h // cfg["num_attention_heads"]
    layer_params = layers * sum(n * k for n, k in layer_shapes(cfg))
    head_params = vocab * h
    mean_prompt = prompt_tokens / requests
    mean_context = mean_prompt + output_tokens / requests / 2
    # causal attention of a prompt: QK^T and PV, 2 FLOPs per multiply-add, half the square
    prefill_flops = (2 * prompt_tokens * layer_params + 2 * requests * head_params
                     + requests * layers * 2 * 2 * heads * d * mean_prompt ** 2 / 2)
    prefill_s = prefill_flops / (gflop_s * 1e9)
    steps = (output_tokens - requests) / slots
    step_bytes = 4 * (layer_params + head_params) + slots * layers * 2 * kv * d * 4 * mean_context
    step_flops = slots * (2 * (layer_params + head_params) + layers * 2 * 2 * heads * d * mean_context)
    step_s = max(step_bytes / (read_gb_s * 1e9), step_flops / (gflop_s * 1e9))
    return {
        "prefill_s": round(prefill_s, 2),
        "decode_steps": round(steps, 1),
        "decode_step_ms": round(1000 * step_s, 2),
        "decode_step_bound": "memory" if step_bytes / read_gb_s > step_flops / gflop_s else "compute",
        "decode_s": round(steps * step_s, 2),
        "total_s": round(prefill_s + steps * step_s, 2),
        "mean_context": round(mean_context, 1),
        "workload": {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "requests": requests,
                     "slots": slots},
    }


BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
"""Bytes a weight takes at each precision slotserve converts to (``int8`` / ``int4``: codes only,
their per-group scales not counted); ``gguf`` is the file's own per-tensor sizes."""


def stream_bandwidth(mib: int = 1024, passes: int = 5) -> dict:
    """This machine's memory bandwidth through torch at the current thread count: GB/s (1e9 bytes)
    of ``Tensor.sum`` over one ``mib``-MiB fp32 tensor (bytes read) and of ``copy_`` into another
    (bytes read + written), the fastest of ``passes`` after a warm-up (:func:`best_ms`). ``mib``
    should be well above the last-level cache (a few tens of MiB on a server part)."""
    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    with torch.inference_mode():
        read_ms = best_ms(lambda: src.sum(), passes)
        copy_ms = best_ms(lambda: dst.copy_(src), passes)
    return {"tensor_mib": mib, "threads": torch.get_num_threads(),
            "read_gb_s": round(src.nbytes / read_ms / 1e6, 2), "copy_gb_s": round(2 * src.nbytes / copy_ms / 1e6, 2)}


def step_tensors(gguf_path) -> list[tuple[tuple[int, ...], int]]:
    """``(shape, ggml_type)`` of each tensor one decode step reads whole, for the model in the GGUF
    file at ``gguf_path``: every tensor but the token embedding (a step reads only its rows), plus
    the embedding again as the LM head when the file has no ``output.weight`` (tied). Read from
    the header alone."""
    from worker.models.gguf_header import read_table

    entries = {name: (tuple(int(d) for d in shape), ggml_type)
               for name, shape, ggml_type, _ in read_table(str(gguf_path)).entries}
    if "output.weight" not in entries and "token_embd.weight" in entries:
        entries["output.weight"] = entries["token_embd.weight"]  # tied: the head reads the embedding whole
    return [entry for name, entry in entries.items() if name != "token_embd.weight"]


def step_macs(gguf_path) -> int:
    """Multiply-adds of one decode row's products for the model in the GGUF file at ``gguf_path``:
    one per element of every matrix (2-D tensor) :func:`step_tensors` lists (norm vectors and
    attention over the cache not counted)."""
    return sum(math.prod(shape) for shape, _ in step_tensors(gguf_path) if len(shape) == 2)


def step_weight_bytes(gguf_path, precision: str) -> int:
    """Bytes of weights one decode step reads (:func:`step_tensors`) for the model in the GGUF file
    at ``gguf_path`` served at ``precision`` (a key of :data:`BYTES_PER_PARAM`, or ``"gguf"``).
    Raises ValueError for another precision."""
    import gguf

    if precision != "gguf" and precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision {precision!r}: one of {sorted(BYTES_PER_PARAM)} or 'gguf'")
    total = 0.0
    for shape, ggml_type in step_tensors(gguf_path):
        count = math.prod(shape)
        if precision == "gguf":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            total += count // block * size
        else:
            total += count * BYTES_PER_PARAM[precision]
    return int(total)


def decode_floor_ms(weight_bytes: int, read_gb_s: float) -> float:
    """The least time (ms) a decode step can take: its weight bytes read at ``read_gb_s`` (GB/s)
    -- the memory roofline of one step whatever its rows, KV-cache reads and compute not counted."""
    if read_gb_s <= 0:
        raise ValueError(f"read_gb_s must be > 0, got {read_gb_s}")
    return weight_bytes / (read_gb_s * 1e9) * 1000


def compute_floor_ms(macs_per_row: int, rows: int, gmac_s: float) -> float:
    """The least time (ms) ``rows`` decode rows' products can take at ``gmac_s`` (1e9 multiply-adds
    a second, e.g. :func:`int8_peak`'s ``gmac_s``): the compute roofline of one step, memory not counted."""
    if gmac_s <= 0 or rows < 1:
        raise ValueError(f"gmac_s must be > 0 and rows >= 1, got {gmac_s} and {rows}")
    return macs_per_row * rows / (gmac_s * 1e9) * 1000


def model_floors(models: list[str], precisions: list[str], read_gb_s: float, rows: int = 8,
                 int8_gmac_s: float | None = None) -> dict:
    """``{model: {precision: {"weight_mb", "floor_ms", "tokens_per_s_per_slot"}}}``: each model's
    (alias or ``.gguf`` path) decode-step floor at each precision (:func:`step_weight_bytes`,
    :func:`decode_floor_ms`); ``tokens_per_s_per_slot``: one sequence's decode rate at the floor.
    With ``int8_gmac_s`` (:func:`int8_peak`), ``gguf`` also gets ``compute_floor_ms``, its products
    at ``rows`` rows (int8 activations, as the gguf worker runs them) at that peak
    (:func:`compute_floor_ms`), and ``macs_per_row``."""
    from worker.models.checkpoint import resolve_model_path

    out = {}
    for model in models:
        folder, name = resolve_model_path(model)
        if name is None:
            raise ValueError(f"model {model!r} is not a GGUF file or alias: its weights' sizes are read from one")
        out[model] = {}
        for precision in precisions:
            nbytes = step_weight_bytes(Path(folder) / name, precision)
            floor = decode_floor_ms(nbytes, read_gb_s)
            out[model][precision] = {"weight_mb": round(nbytes / 2**20, 1), "floor_ms": round(floor, 2),
                                     "tokens_per_s_per_slot": round(1000 / floor, 1)}
            if precision == "gguf" and int8_gmac_s:
                macs = step_macs(Path(folder) / name)
                out[model][precision].update(macs_per_row=macs, rows=rows,
                                             compute_floor_ms=round(compute_floor_ms(macs, rows, int8_gmac_s), 2))
    return out


PEAK_SOURCE = Path(__file__).with_name("int8_peak.c")
"""The int8 multiply-add probes :func:`int8_peak` compiles and runs."""


def int8_peak(threads: int, seconds: float = 0.3, passes: int = 3) -> dict:
    """This CPU's int8 multiply-add peak: :data:`PEAK_SOURCE` compiled with the C compiler (``$CC``,
    else ``cc``) and its probe for the CPU's best int8 instruction (AVX-512 VNNI's ``vpdpbusd``, else
    AVX2's ``vpmaddubsw`` + ``vpaddw``, by ``/proc/cpuinfo``'s flags:
    :func:`worker.models.llama.extension.cpu_has`; AMX tiles not measured) run for about ``seconds`` on
    ``threads`` threads at once (ctypes lets go of the GIL), the best of ``passes``.

    Returns ``{"instruction", "threads", "per_thread_gmac_s", "gmac_s"}`` (1e9 multiply-adds a
    second: a thread's, and all threads' summed), or ``{"skipped": why}`` where the CPU has neither
    instruction set or no compiler runs."""
    import ctypes
    import os
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from worker.models.llama.extension import cpu_has

    if all(cpu_has(f) for f in ("avx512f", "avx512bw", "avx512_vnni")):
        probe, instruction, macs = "int8_peak_vnni", "vpdpbusd zmm (AVX-512 VNNI)", 8 * 64
    elif cpu_has("avx2"):
        probe, instruction, macs = "int8_peak_avx2", "vpmaddubsw + vpaddw ymm (AVX2)", 6 * 32
    else:
        return {"skipped": "the CPU has neither AVX2 nor AVX-512 VNNI"}
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return {"skipped": "no C compiler (cc, or $CC) on PATH"}
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "int8_peak.so"
        built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(PEAK_SOURCE)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return {"skipped": f"{cc} failed: {built.stderr.strip()[-300:]}"}
        fn = getattr(ctypes.CDLL(str(lib)), probe)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long]
    iters = max(1000, int(seconds * fn(100_000) / macs))  # calibrated by a short run
    best = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            rates = list(pool.map(fn, [iters] * threads))
            if sum(rates) > sum(best):
                best = rates
    return {"instruction": instruction, "threads": threads, "per_thread_gmac_s": round(min(best) / 1e9, 1),
            "gmac_s": round(sum(best) / 1e9, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as bench/model.py)")
    ap.add_argument("--rows", default="1,8,24", help="activation rows per product, comma-separated (default 1,8,24)")
    ap.add_argument("--passes", type=int, default=7, help="timed passes per measurement, fastest kept (default 7)")
    ap.add_argument("--prompt-tokens", type=int, default=3200, help="HE32 prompt tokens (default 3200)")
    ap.add_argument("--output-tokens", type=int, default=1958, help="HE32 greedy output tokens (default 1958)")
    ap.add_argument("--requests", type=int, default=32, help="requests (default 32)")
    ap.add_argument("--slots", type=int, default=8, help="decode rows per step (default 8)")
    ap.add_argument("--tiny", action="store_true", help="2 small layers, 2 passes: plumbing only")
    ap.add_argument("--models", default="",
                    help="comma-separated model aliases or .gguf files whose decode-step memory floor to report "
                         "(e.g. qwen2.5-coder-0.5b,qwen2.5-coder-1.5b; default none)")
    ap.add_argument("--precisions", default="fp32,bf16,gguf",
                    help="precisions of the --models floors: fp32, bf16, fp16, int8, int4, gguf "
                         "(default fp32,bf16,gguf)")
    ap.add_argument("--stream-mib", type=int, default=1024,
                    help="MiB of the tensor the stream bandwidth is measured on (default 1024; --tiny: 64)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.passes < 1:
        ap.error("--rows needs positive integers and --passes >= 1")
    torch.set_num_threads(args.threads)
    cfg = {**SHAPES["smollm2-135m"], **(TINY if args.tiny else {})}
    passes = 2 if args.tiny else args.passes
    t = time.monotonic()
    machine = machine_record()
    payload = {"model_shape": "smollm2-135m" + (" (tiny)" if args.tiny else ""), "threads": args.threads}
    payload.update(measure(cfg, rows, passes))
    payload["he32_floor"] = he32_floor(cfg, payload["read_gb_s"], payload["fp32_gemm_gflop_s"], args.prompt_tokens,
                                       args.output_tokens, args.requests, args.slots)
    payload["stream"] = stream_bandwidth(64 if args.tiny else args.stream_mib, passes)
    payload["int8_peak"] = int8_peak(args.threads, 0.05 if args.tiny else 0.3, passes)
    models = [m for m in args.models.split(",") if m]
    if models:
        try:
            payload["decode_floor"] = model_floors(models, [p for p in args.precisions.split(",") if p],
                                                   payload["stream"]["read_gb_s"], args.slots,
                                                   payload["int8_peak"].get("gmac_s"))
        except ValueError as exc:
            ap.error(str(exc))
    payload["total_s"] = round(time.monotonic() - t, 1)

    print(f"read bandwidth {payload['read_gb_s']} GB/s; fp32 GEMM peak {payload['fp32_gemm_gflop_s']} GFLOP/s "
          f"({args.threads} threads; {payload['layer_weight_mb']} MB of layer weights)")
    for name, k in payload["kinds"].items():
        print(f"{name:>12}: " + ", ".join(f"{m} rows {ms} ms ({k['implied_gb_s'].get(m, '-')} GB/s)"
                                          for m, ms in k["ms"].items()))
    f = payload["he32_floor"]
    print(f"HE32 floor, exact fp32: prefill {f['prefill_s']} s + {f['decode_steps']} decode steps x "
          f"{f['decode_step_ms']} ms ({f['decode_step_bound']}-bound) = {f['total_s']} s")
    st = payload["stream"]
    print(f"stream: sum {st['read_gb_s']} GB/s, copy {st['copy_gb_s']} GB/s ({st['tensor_mib']} MiB fp32 tensor)")
    peak = payload["int8_peak"]
    print(f"int8 multiply-add peak: {peak['skipped']}" if "skipped" in peak else
          f"int8 multiply-add peak, {peak['instruction']}: {peak['gmac_s']} GMAC/s on {peak['threads']} thread(s) "
          f"({peak['per_thread_gmac_s']} a thread)")
    for model, by_precision in payload.get("decode_floor", {}).items():
        print(f"decode-step memory floor of {model}: " + "; ".join(
            f"{p} {v['weight_mb']} MiB -> {v['floor_ms']} ms ({v['tokens_per_s_per_slot']} tokens/s a slot)"
            for p, v in by_precision.items()))
        gguf = by_precision.get("gguf", {})
        if "compute_floor_ms" in gguf:
            print(f"  its int8 products at {gguf['rows']} rows at that peak: {gguf['compute_floor_ms']} ms "
                  f"({gguf['macs_per_row'] / 1e9:.2f} GMAC a row)")
    path = write_results(args.out / f"roofline{'_tiny' if args.tiny else ''}.json", payload, machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
