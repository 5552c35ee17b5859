"""bench/gguf_load.py -- where a GGUF model's start goes: the load's phases, the warm-up, RSS and its peak.

Loads ``--model`` (default ``qwen2.5-coder-1.5b``) with slotserve's runner at precision ``gguf``
under ``cProfile``, then warms it up as a worker does (:func:`worker.warmup.warm_up` on an engine
of ``--slots`` slots, not profiled), in this process. Reported, in seconds: the imports before the
load (``torch`` and ``worker.models``: a worker process pays them too), the load's wall time and
the cumulative time of each phase in :data:`PHASES` (a function's calls, under the profiler: its
overhead inflates Python-heavy phases such as imports), the warm-up's wall time; the process's
RSS after the load and after the warm-up, and its peak (``/proc/self/status`` VmRSS, VmHWM: MiB);
the 1-minute load average before and after (a shared machine). ``--top N`` prints the profile's
N functions of most own time as well; ``--no-profile`` loads without the profiler (the load's wall
time alone, no phases).

``--worker``: start to ready instead, as ``bench/model.py`` measures it (``start_to_ready_s``) but
without its reference model loaded first in this process (minutes of load on the machine): a
broker and one worker process serving the model at ``gguf`` (``slotserve.launcher.LocalCluster``,
``--slots`` slots, ``--threads``), from the cluster's start until the worker registered (spawned,
imported, loaded and warmed up); then the worker's RSS and its peak (``/proc/<pid>/status``).

``python -m bench.gguf_load [--model qwen2.5-coder-0.5b] [--threads 2] [--slots 8] [--top 20] [--worker]``.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402

import torch  # noqa: E402

from bench.common import load_avg, own_memory_mib  # noqa: E402
from worker.models import load_model  # noqa: E402

PHASES = (
    ("read the file's header (metadata, tensor table)", "gguf_header.py", "read_table"),
    ("transformers' config object", "checkpoint.py", "gguf_config"),
    ("tensors: read, unpack, repack (all)", "checkpoint.py", "_tensors"),
    ("  quantised tensors into the kernel's layout (C++)", "gguf_blocks.py", "stored_weights"),
    ("  quantised tensors unpacked by numpy (no kernel)", "gguf_blocks.py", "unpack"),
    ("  their file pages dropped (madvise)", "checkpoint.py", "_release"),
    ("  F32/F16 tensors dequantised", "quants.py", "dequantize"),
    ("tokenizer (kept conversion)", "gguf_tokenizer.py", "gguf_tokenizer"),
    ("the compiled kernels' import (qkernel)", "qkernel.py", "load"),
    ("model build (worker.models.llama.from_source)", "llama/__init__.py", "from_source"),
    ("  q/k/v, gate/up fused (QuantizedWeight.cat)", "quantized.py", "cat"),
    ("  repack into the kernel's layout (prepare)", "quantized.py", "prepare"),
    ("freed memory returned", "heap.py", "return_freed_memory"),
)
"""(label, file name, function name): a phase and the function whose cumulative time it is."""


def phase_times(stats: pstats.Stats) -> list[tuple[str, float]]:
    """``(label, cumulative seconds)`` of each of :data:`PHASES` in ``stats``: the largest among the
    functions of that name in that file (methods of one name nest, ``QuantizedWeight.cat`` calling
    ``GroupScales.cat``: the outer one); 0 where none was called."""
    return [(label, max((row[3] for (path, _, func), row in stats.stats.items()
                         if func == name and path.endswith("/" + file)), default=0.0))
            for label, file, name in PHASES]


def worker_start(model: str, threads: int, slots: int) -> None:
    """Print start to ready of a worker process serving ``model`` at ``gguf`` (see the module docstring)."""
    from bench.common import ANY_PORT
    from broker import BrokerConfig
    from slotserve.launcher import ClusterConfig, LocalCluster
    from worker.config import WorkerConfig
    from worker.models import ModelOptions

    options = ModelOptions(device="cpu", runner="slotserve", precision="gguf", num_threads=threads)
    config = ClusterConfig(broker=BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT), start_timeout_s=900.0,
                           workers=(WorkerConfig(model=model, num_slots=slots, model_options=options),))
    before = load_avg()
    started = time.monotonic()
    with LocalCluster(config) as cluster:
        ready_s = time.monotonic() - started
        with open(f"/proc/{cluster.worker_processes[0].pid}/status") as f:
            memory = {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f)
                      if k in ("VmRSS", "VmHWM")}
    print(f"{model}: start to ready {ready_s:.2f} s ({slots} slots, {threads} threads); worker RSS "
          f"{memory['VmRSS']} MiB, peak {memory['VmHWM']} MiB; load average {before} -> {load_avg()}")


def in_process(model_name: str, threads: int, slots: int, profile: bool, top: int) -> None:
    """Print the load's phases (``profile``), the warm-up, RSS and its peak, in this process (module docstring)."""
    imports_s = time.perf_counter() - STARTED
    before = load_avg()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    if profile:
        profiler.enable()
    model = load_model(model_name, precision="gguf", runner="slotserve", num_threads=threads, prefix_cache_mb=0)
    profiler.disable()
    load_s = time.perf_counter() - t0
    rss_load, peak_load = own_memory_mib("VmRSS"), own_memory_mib("VmHWM")
    from worker.engine import BatchInferenceEngine
    from worker.warmup import warm_up

    warm_s = warm_up(BatchInferenceEngine(model, slots)).seconds
    print(f"{model_name}, {torch.get_num_threads()} threads, {getattr(model.weights, 'linear_kind', '')}")
    print(f"{'imports (torch, worker.models)':55s} {imports_s:6.2f}")
    print(f"{'load (load_model' + (', profiled)' if profile else ')'):55s} {load_s:6.2f}")
    stats = pstats.Stats(profiler) if profile else None
    for label, seconds in phase_times(stats) if profile else ():
        print(f"  {label:53s} {seconds:6.2f}")
    print(f"{'warm-up (' + str(slots) + ' slots)':55s} {warm_s:6.2f}")
    print(f"{'load + warm-up':55s} {load_s + warm_s:6.2f}")
    print(f"RSS MiB: after load {rss_load} (peak {peak_load}), after warm-up {own_memory_mib('VmRSS')} "
          f"(peak {own_memory_mib('VmHWM')}); load average {before} -> {load_avg()}")
    if top and stats is not None:
        stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--top", type=int, default=0, help="also print the N functions of most own time")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="load without the profiler")
    parser.add_argument("--worker", action="store_true", help="start to ready of a worker process instead")
    args = parser.parse_args()
    if args.worker:
        worker_start(args.model, args.threads, args.slots)
    else:
        in_process(args.model, args.threads, args.slots, args.profile, args.top)


if __name__ == "__main__":
    main()
