"""How many workers a local cluster starts by default (`slotserve up`, `slotserve run`): as many as fit.

:func:`plan_workers` is the decision, a pure function of the machine
(:class:`Machine`: cores, available memory), the model's estimated memory
(:func:`estimate_model`: :class:`ModelSize`) and the options; the CLI prints
its :attr:`WorkerPlan.reason`.

- **Cores.** On CPU one worker per core, one thread each, at most
  :data:`MAX_WORKERS` (``--threads T``: one per ``T`` cores); cores left over (fewer
  workers than cores) are split among the workers. Measured with SmolLM2-135M
  on a shared 2-core machine (``docs/cluster.md``, "How many workers"): two
  1-thread workers gave 33-39 tok/s together, one 2-thread worker with the
  same 16 slots 8-13 tok/s, using 4x the CPU time per token (torch's OpenMP
  threads wait for each other at every product; a small model's products
  are too small to split well). A second worker costs a second copy of the
  weights, hence the memory check. Workers of a cluster never share threads:
  with more than one, each is given ``cores // workers`` (torch's default is
  every core, in every process).
- **Memory.** Workers load at the same time; a load holds the file's tensors
  dequantised to fp32 beside the runner's copy, so a worker's peak is above
  its steady size (:class:`ModelSize`). The workers' peaks together stay
  within :data:`MEMORY_SHARE` of the available memory.
- On CUDA (``--device cuda``, or ``auto`` on a machine with an NVIDIA device)
  one worker: it batches on the one GPU, and a second would split its memory.
- The simulated model: 2 workers, as before (no weights, no cores to speak of;
  two show the broker's dispatch).

``--workers N`` overrides the count; the threads are still split.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from worker import host_memory

MAX_WORKERS = 8
"""Most workers started by default on CPU; with more cores each gets several threads (a guess
where nothing was measured: one broker dispatching to a handful of workers; ``--workers`` and
``--threads`` override it)."""

MEMORY_SHARE = 0.8
"""Share of the available memory the workers' load peaks may take together."""

BASE_BYTES = 400 * 2**20
"""A worker's memory besides its weights: Python, torch, the tokenizer (measured: a SmolLM2-135M
worker at fp32, 902 MiB RSS with 515 MiB of weights)."""

LOAD_FACTOR = 1.6
"""A load's transient memory in units of the fp32 weights (the dequantised tensors, the mapped file):
measured, SmolLM2-135M's load peaks at 1772 MiB = 400 + 515 + 1.6 x 515."""

BYTES_PER_PARAM = {"fp32": 4.0, "auto": 4.0, "bf16": 2.0, "int8": 1.125, "int4": 0.625}
"""Steady weight bytes per parameter at each CPU precision (int8/int4: codes plus one fp32 scale
per 32 values; ``auto`` is fp32 on CPU). Another precision keeps the file's stored bytes."""


@dataclass(frozen=True, slots=True)
class Machine:
    """What the workers run on: ``cores`` this process may use, ``available_bytes`` of memory
    (:func:`worker.host_memory.available_bytes`: MemAvailable, less under a cgroup limit; None:
    unknown), ``gpu``: an NVIDIA device is present."""

    cores: int
    available_bytes: int | None
    gpu: bool = False

    @classmethod
    def here(cls) -> Machine:
        """This machine (CPU affinity, :mod:`worker.host_memory`, ``/dev/nvidiactl``)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        return cls(cores, host_memory.available_bytes(), os.path.exists("/dev/nvidiactl"))


@dataclass(frozen=True, slots=True)
class ModelSize:
    """A worker's estimated memory for one model: ``steady_bytes`` once loaded (weights at the
    precision plus :data:`BASE_BYTES`) and ``peak_bytes`` while loading."""

    params: int
    steady_bytes: int
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """How many ``workers``, ``threads`` each (None: torch's default, every core), and the
    ``reason`` (one line, printed as the cluster starts)."""

    workers: int
    threads: int | None
    reason: str


def plan_workers(machine: Machine, size: ModelSize | None, *, simulated: bool = False, device: str = "cpu",
                 workers: int | None = None, threads: int | None = None) -> WorkerPlan:
    """The workers to start (see the module docstring). ``size``: :func:`estimate_model`'s, None
    when unknown (cores decide alone); ``workers``/``threads``: ``--workers``/``--threads``, None
    when not given."""
    mem = "" if machine.available_bytes is None else f", {machine.available_bytes / 2**30:.1f} GiB available"
    if simulated:
        n = workers or 2
        return WorkerPlan(n, threads, f"starting {n} simulated worker{'s' * (n > 1)}"
                                      f"{' (--workers)' if workers else ''}")
    per = "" if size is None else f", model ~{size.steady_bytes / 2**20:,.0f} MiB per worker " \
                                  f"(~{size.peak_bytes / 2**20:,.0f} MiB while loading)"
    if workers is None and (device == "cuda" or (device == "auto" and machine.gpu)):
        return WorkerPlan(1, threads, f"starting 1 worker: one GPU{per}{mem}")
    if workers is not None:
        n, why = workers, "--workers"
    else:
        n = max(1, machine.cores // threads if threads else min(MAX_WORKERS, machine.cores))
        why = f"{machine.cores} cores"
        if size is not None and machine.available_bytes is not None:
            fit = int(machine.available_bytes * MEMORY_SHARE // size.peak_bytes)
            if fit < n:
                n, why = max(1, fit), f"{why}, memory for {fit}"
    if threads is None and n > 1:
        threads = max(1, machine.cores // n)
    each = f"{threads} thread{'s' * (threads > 1)} each" if threads else f"{machine.cores} threads"
    warn = ""
    if size is not None and machine.available_bytes is not None \
            and n * size.peak_bytes > machine.available_bytes * MEMORY_SHARE:
        warn = " (may not fit: lower --workers, or a smaller --precision)"
    return WorkerPlan(n, threads, f"starting {n} worker{'s' * (n > 1)} ({why}), {each}{per}{mem}{warn}")


def estimate_model(model: str, precision: str = "auto") -> ModelSize | None:
    """A worker's memory for ``model`` at ``precision``, from the checkpoint's files alone (no
    weights read): a ``.gguf`` file (or an alias shipping one) by its tensor table, a
    ``save_pretrained`` directory by its weight files' sizes and ``torch_dtype``; None for what
    is not on this machine (a hub id) or cannot be read."""
    if model == "simulated":
        return None
    from worker.models.checkpoint import resolve_model_path

    try:
        path, gguf_file = resolve_model_path(model)
        held = None
        if gguf_file is not None:
            params, stored, held = _gguf_params(os.path.join(path, gguf_file))
        elif os.path.isdir(path):
            params, stored = _folder_params(path)
        else:
            return None
    except (OSError, ValueError, KeyError, struct.error):  # not a checkpoint this can read: size unknown
        return None
    if not params:
        return None
    if held is not None and precision in ("auto", "gguf"):  # served as stored (worker.models.load_model)
        steady, largest = held
        return ModelSize(params, BASE_BYTES + steady, BASE_BYTES + steady + largest)
    steady = int(params * BYTES_PER_PARAM[precision]) if precision in BYTES_PER_PARAM else stored
    return ModelSize(params, BASE_BYTES + steady, int(BASE_BYTES + steady + LOAD_FACTOR * 4 * params))


def _gguf_params(path: str) -> tuple[int, int, tuple[int, int] | None]:
    """``(parameters, stored bytes, held)`` of a GGUF file, from its tensor table. ``held``: where
    the file has block-quantised matrices precision gguf keeps as stored, ``(steady bytes, load
    transient)``: those as :func:`worker.models.gguf_blocks.held_bytes`, every other tensor fp32,
    and the largest tensor's int8 codes plus its mapped bytes (a load's peak above the steady
    state; measured SmolLM2-135M 31 MiB, Qwen2.5-Coder-0.5B 92-157 MiB); None for a file without."""
    import math

    from worker.models.gguf_blocks import FORMATS, held_bytes
    from worker.models.gguf_header import read_table

    table = read_table(path)
    params = sum(math.prod(shape) for _, shape, *_ in table.entries)
    steady, largest, quantised = 0, 0, False
    for _, shape, ggml_type, _ in table.entries:
        n = math.prod(shape)
        fmt = _GGML_NAMES.get(ggml_type)
        if fmt in FORMATS and len(shape) == 2:
            quantised = True
            steady += held_bytes(fmt, *shape)
            largest = max(largest, 2 * n)  # int8 codes, and about as many bytes of the file mapped
        else:
            steady += 4 * n
    return params, os.path.getsize(path), (steady, largest) if quantised else None


_GGML_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
"""ggml type ids (llama.cpp's ``ggml_type``, the ``gguf`` package's ``GGMLQuantizationType``) of the
block formats precision gguf keeps as stored (without importing the ``gguf`` package here)."""


def _folder_params(path: str) -> tuple[int, int]:
    """``(parameters, stored bytes)`` of a ``save_pretrained`` folder: its ``*.safetensors`` (else
    ``*.bin``) bytes over the ``torch_dtype`` of ``config.json`` (4 bytes when it says none)."""
    import json

    names = os.listdir(path)
    files = [n for n in names if n.endswith(".safetensors")] or [n for n in names if n.endswith(".bin")]
    stored = sum(os.path.getsize(os.path.join(path, n)) for n in files)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    return stored // itemsize, stored
