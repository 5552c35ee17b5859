"""Embeddings: slotserve's in-process embedding engine against sentence-transformers' own ``encode``.

    python -m bench.embeddings [--sentences 1000] [--slots 256] [--rounds 5] [--threads 2] [--broker]

The workload: ``--sentences`` lines of the HumanEval prompts' docstrings (:func:`sentences`: each
prompt's lines stripped of indentation and of a doctest's ``>>>``, the ``def`` / ``import`` lines and
the docstring quotes left out, duplicates dropped, in problem order: 1,143 lines, 4 to 60 tokens),
embedded by all-MiniLM-L6-v2 (fp32, CPU) two ways in the same process, alternating, each
``--rounds`` times after a warm-up of each:

- **sentence-transformers**: ``SentenceTransformer(folder).encode(sentences)`` (its defaults:
  batches of 32, sorted by length);
- **slotserve**: the in-process :class:`~worker.embeddings.EmbeddingEngine` (``--slots`` requests a
  step, as ``slotserve worker --slots``; also with 64 when ``--slots`` is larger) over the same folder
  loaded by ``load_model`` (transformers' ``AutoModel`` and the folder's pooling): every sentence
  submitted as a text request (tokenised on submission, as a worker does on arrival), then ``run()``.

- with ``--broker``, **slotserve through the broker** too: a broker and one worker process serving
  the same model with ``--slots`` slots (:class:`~slotserve.launcher.LocalCluster`), every sentence
  sent by one :class:`~client.Client` (``embed``, then ``run``): the wire, the broker's queue and
  credits, the worker's tokenising and its engine. The worker process idles while the others run.

Reported: the median sentences/s of each, their ratio (the target of issue 34: >= 0.8, for
``--slots``), and the largest absolute difference between the two systems' vectors (target: <= 1e-5).
The machine is shared: rounds alternate the systems, so a burst of other work slows each in turn,
and the median of ``--rounds`` is taken. Prints a table; writes
bench/results/embeddings.json with the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from pathlib import Path

from bench.common import ANY_PORT, RESULTS, humaneval_problems, load_avg, machine_record, write_results

MODEL = "all-minilm-l6-v2"


def sentences(n: int) -> list[str]:
    """The first ``n`` docstring lines of the HumanEval prompts (see the module docstring). ValueError
    when there are fewer than ``n``."""
    out: dict[str, None] = {}
    for problem in humaneval_problems():
        for line in problem["prompt"].splitlines():
            s = line.strip().removeprefix(">>> ")
            if s and not s.startswith(("def ", "from ", "import ", '"""', "'''", "@")):
                out[s] = None
    if len(out) < n:
        raise ValueError(f"the HumanEval prompts hold {len(out)} docstring lines, fewer than {n}")
    return list(out)[:n]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=1000, help="sentences per batch (default 1000)")
    ap.add_argument("--slots", type=int, default=256, help="the engine's requests per step (default 256)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each system (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--broker", action="store_true", help="also through a broker and a worker process")
    ap.add_argument("--out", type=Path, default=RESULTS / "embeddings.json")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        client = _broker_client(stack, args.slots, args.threads) if args.broker else None
        return _run(args, client)


def _broker_client(stack: contextlib.ExitStack, slots: int, threads: int | None):
    """A client of a broker with one worker serving :data:`MODEL` (both stopped when ``stack`` closes)."""
    from broker import BrokerConfig
    from client import Client
    from slotserve.launcher import ClusterConfig, LocalCluster
    from worker.config import WorkerConfig
    from worker.models import ModelOptions

    worker = WorkerConfig(model=MODEL, num_slots=slots,
                          model_options=ModelOptions(device="cpu", precision="fp32", num_threads=threads))
    cluster = stack.enter_context(LocalCluster(ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                                                             (worker,))))
    client = stack.enter_context(Client(cluster.frontend, model=MODEL, name="bench-embeddings"))
    client.wait_for_model(120)
    return client


def _run(args: argparse.Namespace, client) -> dict:

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from worker.embeddings import EmbeddingEngine
    from worker.models import load_model
    from worker.models.checkpoint import resolve_model_path

    machine = machine_record()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    texts = sentences(args.sentences)
    folder = resolve_model_path(MODEL)[0]
    st = SentenceTransformer(folder, device="cpu")
    model = load_model(MODEL, device="cpu", precision="fp32", num_threads=args.threads)
    engines = {"slotserve": EmbeddingEngine(model, args.slots)}
    if args.slots > 64:
        engines["slotserve_64_slots"] = EmbeddingEngine(model, 64)

    def ours(engine: EmbeddingEngine) -> np.ndarray:
        handles = [engine.submit_request(t) for t in texts]
        engine.run()
        return np.array([h.embedding for h in handles], dtype=np.float32)

    def theirs() -> np.ndarray:
        return st.encode(texts, convert_to_numpy=True)

    def through_broker() -> np.ndarray:
        handles = [client.embed(t) for t in texts]
        client.run(600)
        return np.array([h.embedding for h in handles], dtype=np.float32)

    systems = {name: functools.partial(ours, e) for name, e in engines.items()}
    if client is not None:
        systems["slotserve_broker"] = through_broker
    systems["sentence_transformers"] = theirs
    for run in systems.values():  # warm-up (first forwards: allocator, oneDNN primitives)
        run()
    times: dict[str, list[float]] = {name: [] for name in systems}
    diff = 0.0
    for _ in range(args.rounds):
        vectors = {}
        for name, run in systems.items():
            t0 = time.perf_counter()
            vectors[name] = run()
            times[name].append(time.perf_counter() - t0)
        reference = vectors.pop("sentence_transformers")
        diff = max(diff, *(float(np.abs(v - reference).max()) for v in vectors.values()))
    rate = {k: len(texts) / statistics.median(v) for k, v in times.items()}
    ratio = rate["slotserve"] / rate["sentence_transformers"]
    ratios = {name: r / rate["sentence_transformers"] for name, r in rate.items() if name != "sentence_transformers"}
    tokens = [len(model.tokenize(t)) for t in texts]
    payload = {
        "model": MODEL, "sentences": len(texts), "tokens": sum(tokens), "tokens_min_max": [min(tokens), max(tokens)],
        "slots": args.slots, "threads": torch.get_num_threads(), "rounds": args.rounds,
        "path": "in-process EmbeddingEngine" + (", and a broker with one worker process (slotserve_broker)"
                                                 if client is not None else " (no broker)"),
        "seconds": times, "sentences_per_s": rate, "ratio": ratio, "ratios": ratios, "target_ratio": 0.8,
        "max_abs_diff": diff, "target_max_abs_diff": 1e-5,
        "load_avg_before_after": [machine["load_avg_before_after"][0], load_avg()],
    }
    print(f"{len(texts)} sentences ({sum(tokens)} tokens), {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds, load {payload['load_avg_before_after']}")
    for k, v in rate.items():
        print(f"  {k:22s} {v:8.1f} sentences/s  ({statistics.median(times[k]):.3f} s)")
    print(f"  ratio slotserve / sentence-transformers: {ratio:.3f} (target >= 0.8; "
          + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if k != "slotserve")
          + f"); max |diff| {diff:.2e} (target <= 1e-5)")
    print(f"wrote {write_results(args.out, payload, machine)}")
    return payload


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
