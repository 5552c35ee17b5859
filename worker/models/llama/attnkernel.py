"""The compiled decode attention (``attnkernel.cpp``, issue 32), built once per machine, and the
layer's small operations beside it (``rms_norm``; ``rope_finite_``: the new keys and values made
finite, then RoPE on the queries and keys, in place; ``silu_mul``: SwiGLU's ``silu(gate) * up``),
one call each where :mod:`worker.models.llama.model` took 7, about 8 and 2 ATen operations
(SmolLM2's decode step: 2,063 -> 1,367 operations, ~10 % of its time, before ``silu_mul``). The
module is built with ``-ffp-contract=off``, so every product and sum rounds as those operations did
(RoPE and SwiGLU stay ATen's bit for bit, SwiGLU's ``exp`` being ATen's own Sleef call, row by row as
ATen runs a row whole: where ATen's parallel split of a large tensor falls inside a row, its vector
chunks and scalar tail lie elsewhere there, so that row's values can differ from ATen's by its exp's
ulp; here a row's values never depend on the batch; RMSNorm's sum of squares runs in another order). ``silu_mul`` against ``F.silu(gate).mul_(up)`` (2-core AMD
EPYC Zen 3, 2 threads, best of 7 x 2,000 calls): 34.7 -> 15.6 us at 8 x 1,536 (SmolLM2), 39.1 ->
24.7 at 8 x 4,864 (Qwen2.5-0.5B), 593 -> 472 at 128 x 4,864.

One call per layer does what the batched path of
:func:`~worker.models.llama.attention.decode_attention` does in a dozen
operations (an indexed write, views, ``baddbmm``, ``softmax``, ``bmm``):

1. it stores the iteration's new keys and values (every entry, decode and
   prefill) at their cache rows and positions, rounded to the cache's dtype
   as ``Tensor.to`` rounds (fp32, bf16 or fp16 caches);
2. for each decode entry and key/value head (one task each, spread over
   torch's intra-op threads), it scores the group's query heads against the
   entry's own keys ``[max(0, length - window), length)`` only -- no padded
   positions, no mask -- with one pass over the keys for the whole group,
   soft-caps the scores where the family does, takes the softmax (fp32,
   ``exp`` to within 2 ulp: ATen's ``exp_u20``) and the weighted sum of the
   values in a second pass. Keys are scored 8 at a time for up to 3 heads of
   the group (each key's columns loaded once for them; the 8 dot products'
   lanes summed by one transposing tree, not a horizontal sum each), the
   softmax's max is a vector one and its 1 / sum scales the weighted sums, not
   each numerator, and the weighted sum keeps up to 4 heads x 64 columns in
   registers. At 8 rows and 160 keys, Qwen2.5-1.5B's 28 layers took 4.9 ms
   with 16 keys a head at a time, against 7.0 with a horizontal sum per key
   and the sums in memory (fp32 cache, 2 threads); at 200 keys over an fp16
   cache, the 3 heads a key: SmolLM2's 30 layers 2.27 -> 1.91 ms, the 0.5B's
   2.02 -> 1.68, the 1.5B's 3.75 -> 3.26 (same process, best of 15).

Each entry's result depends on its own query, keys and length only (never on
the other rows of the batch or on the longest row), so it is batch-invariant
by construction. The runner gives it prefill entries too (a prompt token at
position ``p``: its row, length ``p + 1``; :mod:`worker.models.llama.model`),
so a prompt's attention is its decode's whatever the chunks. Against
``F.scaled_dot_product_attention`` over a 512-token chunk (Qwen2.5-1.5B's 12
heads and 2 key/value heads, fp16 cache, 2 threads, one layer): 10.3 against
9.8 ms at the start of a prompt, 49 against 43 ms at 1,536 cached keys, 102
against 86 ms at 3,584 (SDPA's figures include widening the cache's keys to
fp32). It agrees with the batched path to fp32 rounding (measured ~5e-7
absolute on unit-normal data; tested).

:func:`load` compiles it with torch's C++ extension builder the first time a
process needs it (minutes on a busy 2-core machine; cached under
``~/.cache/slotserve/kernels`` keyed by the source, torch's version and the
flags, so later processes import it in milliseconds) and returns None where
it cannot run: a CPU with neither AVX-512 (``avx512f``) nor AVX2 with FMA and F16C (built then
with :data:`FLAGS_AVX2`: the same algorithm on 8-lane vectors), no C++ compiler, or
``SLOTSERVE_NO_KERNELS`` set; the runner then takes the batched path.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from worker.models.llama import extension

SOURCE = Path(__file__).with_name("attnkernel.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
         "-DCPU_CAPABILITY=AVX512", "-fopenmp", "-ffp-contract=off"]
FLAGS_AVX2 = ["-O3", "-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-fopenmp",
              "-ffp-contract=off"]
"""The same source on a CPU with AVX2, FMA and F16C but no AVX-512 (8 lanes a vector)."""
LANES = 16
"""fp32 lanes of one AVX-512 register (two AVX2 ones): the head dimension must be a multiple of it."""


def cpu_has_avx512() -> bool:
    """Whether ``/proc/cpuinfo`` lists ``avx512f`` (False where it cannot be read)."""
    return extension.cpu_has("avx512f")


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (``decode_attention``), or None where it cannot be built or run here
    (see the module docstring)."""
    if not cpu_has_avx512() and extension.cpu_has_avx2():
        return extension.build("attnkernel_avx2", SOURCE, FLAGS_AVX2, "avx2", "decode attention runs as batched products")
    return extension.build("attnkernel", SOURCE, FLAGS, "avx512f", "decode attention runs as batched products")


@functools.lru_cache(maxsize=1)
def swiglu_exact() -> bool:
    """Whether the module's ``silu_mul`` rounds as ATen's ``silu`` does in this process: ATen's CPU
    kernels run at the vector width the module was built for (``torch.backends.cpu.get_cpu_capability()``
    ``"AVX512"`` for the AVX-512 build, ``"AVX2"`` for the AVX2 one; ``ATEN_CPU_CAPABILITY`` can move
    ATen to another, whose ``exp`` and scalar tail differ). Elsewhere the forward keeps ATen's two
    operations."""
    return torch.backends.cpu.get_cpu_capability() == ("AVX512" if cpu_has_avx512() else "AVX2")


def runs(kv: torch.Tensor, act_dtype: torch.dtype) -> bool:
    """Whether the kernel runs a cache like ``kv`` (``[layers, 2, rows, kv_heads, capacity, D]``) for
    activations of ``act_dtype``: on CPU, fp32 activations, an fp32, bf16 or fp16 cache, ``D`` a
    multiple of :data:`LANES`."""
    return (kv.device.type == "cpu" and act_dtype == torch.float32 and kv.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and kv.shape[-1] % LANES == 0)
