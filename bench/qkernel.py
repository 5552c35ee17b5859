"""bench/qkernel.py -- what a product with GGUF-quantised weights costs, per kind, at 1 to 512 rows.

One decoder layer's four linears of a model's shapes (default Qwen2.5-1.5B's:
qkv 2048x1536, o 1536x1536, gate-up 17920x1536, down 1536x8960), random codes
of two formats as Q4_K_M files hold them (Q4_K: 4-bit codes, an fp16 d and
dmin per 256 columns and a 6-bit scale and min per 32; Q6_K: 6-bit codes, an
fp16 d per 256 and an int8 scale per 16), multiplied by ``rows`` activation rows:

- ``kernel``: the compiled product on the codes as stored (:mod:`worker.models.llama.qkernel`;
  AMX-BF16 tiles where the process may use them), activations rounded to bf16; ``avx512``: its
  AVX-512 BF16 product (what a CPU without AMX runs), up to 64 rows;
- ``int8``: what ``--gguf-activations int8`` (where the CPU has VNNI and VBMI) runs: activations
  rounded to int8 per group on VNNI (up to 8 rows) or AMX-INT8 tiles (up to 64), above 64 rows (AMX)
  the weights decoded to bf16 tiles per block (``qmm_tiles``); on an AVX2 CPU (no AVX-512 BF16)
  ``qkernel_avx2.cpp``'s product, the only compiled kind there (``kernel``, ``avx512`` and ``wide-*``
  are absent: they need ``qkernel.cpp``);
- ``wide-bf16`` / ``wide-fp32``: the layer dequantised for the call (``W.T``)
  and one ``torch.mm`` (bf16: oneDNN's AMX / AVX-512 BF16 product);
- ``bf16-dense``: a bf16 weight at rest, ``F.linear`` (what ``--precision bf16`` runs);
- ``int4pack``: torch's own ``_weight_int4pack_mm_for_cpu`` (bf16 scales, so not the file's weights).

Times are the best of ``--passes`` per kind, the kinds taking turns pass by
pass; ms per layer. Run: ``python -m bench.qkernel [--threads 1 2] [--rows 1 8 32 512]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import machine_record, write_results
from worker.models.llama import qkernel
from worker.models.llama.linear import best_times
from worker.models.llama.quantized import GroupScales, QuantizedWeight

SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))
RESULTS = Path(__file__).with_name("results") / "qkernel.json"


def layer(fmt: str, gen: torch.Generator) -> list[QuantizedWeight]:
    """One layer of random ``fmt`` ("Q4_K" or "Q6_K") weights of :data:`SHAPES`, prepared for the kernel."""
    lo, hi, group = (0, 16, 32) if fmt == "Q4_K" else (-32, 32, 16)
    out = []
    for n, k in SHAPES:
        codes = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen)

        def factors(sign: float, dtype, low: int, high: int) -> GroupScales:
            d = (torch.rand(n, k // 256, generator=gen) * sign * 1e-3).half()  # per super-block
            return GroupScales(d, torch.randint(low, high, (n, k // group), dtype=dtype, generator=gen), 256 // group)

        if fmt == "Q4_K":
            scales, offsets = factors(1.0, torch.uint8, 0, 64), factors(-1.0, torch.uint8, 0, 64)
        else:
            scales, offsets = factors(1.0, torch.int8, -128, 128), None
        out.append(QuantizedWeight(codes, scales, offsets, group, fmt).prepare())
    return out


def kinds(rows: int, gen: torch.Generator) -> dict:
    """name -> a no-argument callable running one layer's products at ``rows`` rows."""
    q4, q6 = layer("Q4_K", gen), layer("Q6_K", gen)
    if q4[0].kernel is None:
        raise SystemExit("the GGUF kernel does not run here (neither AVX-512 BF16 nor AVX2, or no compiler)")
    bf16 = qkernel.runs_bf16(q4[0].kernel.module)  # (an AVX2 CPU's module multiplies int8 activations alone)
    xs = [torch.randn(rows, k, generator=gen) for _, k in SHAPES]
    dense = [torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES]
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
              for n, k in SHAPES]
    sz = [torch.rand(k // 32, n, 2).bfloat16() for n, k in SHAPES]

    def run(f):
        return lambda: [f(i, x) for i, x in enumerate(xs)]

    table = {
        # what serving runs (AMX where the process may), with int8 and with bf16 activations
        "kernel Q4_K": run(lambda i, x: q4[i].kernel._qmm(x.bfloat16().contiguous(), q4[i].kernel.amx)),
        "kernel Q6_K": run(lambda i, x: q6[i].kernel._qmm(x.bfloat16().contiguous(), q6[i].kernel.amx)),
        "wide-bf16 Q4_K": run(lambda i, x: q4[i].kernel.wide(x, True)),
        "wide-fp32 Q4_K": run(lambda i, x: q4[i].kernel.wide(x, False)),
    } if bf16 else {}
    table |= {
        "bf16-dense": run(lambda i, x: F.linear(x.bfloat16(), dense[i])),
        "int4pack": run(lambda i, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed[i], 32, sz[i])),
    }
    if q4[0].kernel.module.has_q8():  # int8 activations (--gguf-activations int8: VNNI and VBMI, or AVX2)
        q4i, q6i = layer("Q4_K", gen), layer("Q6_K", gen)
        for w in q4i + q6i:
            w.kernel.set_activations("int8")
        table["int8 Q4_K"] = run(lambda i, x: q4i[i].kernel(x))
        table["int8 Q6_K"] = run(lambda i, x: q6i[i].kernel(x))
    if q4[0].kernel.amx and rows <= 64:  # the AVX-512 BF16 product that CPUs without AMX run
        table["avx512 Q4_K"] = run(lambda i, x: q4[i].kernel._qmm(x.bfloat16().contiguous(), False))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.qkernel", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    machine = machine_record()
    gen = torch.Generator().manual_seed(0)
    table = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            best = best_times(kinds(rows, gen), args.passes if rows < 512 else 2)
            table[f"{threads}t x {rows}"] = {k: round(v * 1e3, 2) for k, v in best.items()}
            print(f"{threads} thread(s), {rows:>3} rows: " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in best.items()),
                  flush=True)
    write_results(RESULTS, {"shapes": SHAPES, "ms_per_layer": table}, machine)
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
