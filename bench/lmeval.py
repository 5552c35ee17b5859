"""lm-evaluation-harness as a client: slotserve against lm-eval's own ``hf`` model.

Runs the local task pair ``bench/lm_eval_tasks/slotserve_facts`` (64 questions
of facts.jsonl, nothing from a hub) twice on the same weights:

- through slotserve: a broker, one worker and the HTTP gateway (what
  ``slotserve up --model MODEL --http-port 0`` starts), with lm-eval's
  ``local-completions`` model for ``slotserve_facts_mc`` (loglikelihood: each
  request is ``{"prompt": [[token ids]], "max_tokens": 1, "logprobs": 1,
  "echo": true, "temperature": 0}`` and lm-eval sums the continuation's
  ``token_logprobs``) and ``local-chat-completions`` for ``slotserve_facts_gen``
  (generate_until, greedy, the chat template applied by the server);
- in process with lm-eval's ``hf`` model (HFLM, transformers' forward and
  ``generate``, fp32; a ``.gguf`` file is dequantised by transformers through
  HFLM's ``gguf_file`` argument), the chat template applied by lm-eval from the
  same tokenizer.

Compared per request: the loglikelihood of every (question, choice) pair (max
absolute difference; fp32 must agree within 1e-3), the chosen choice of every
question (acc and acc_norm), the reply of every chat question (identical
text), and each task's accuracy. Prompts go to ``local-completions`` as token
ids (``tokenized_requests=True``, lm-eval's default): lm-eval tokenises
context and continuation itself to know where the continuation starts, so
sending ids scores exactly the tokens HFLM scores; sending text would let the
server re-tokenise the joined string, and a merge across the boundary would
shift the continuation. That tokenizer is the model's own, written once to a
temporary folder with ``save_pretrained`` (lm-eval's API models take a
tokenizer folder or hub name, not a ``.gguf``).

Prints a table; writes ``bench/results/lmeval[_MODEL].json`` with the load
averages (the machine is shared).

    python -m bench.lmeval                      # smollm2-135m, the whole task (several minutes)
    python -m bench.lmeval --limit 8            # the first 8 questions
    python -m bench.lmeval --model DIR          # any local HF folder or .gguf file
    python -m bench.lmeval --write-tokenizer DIR  # only write the model's tokenizer folder (for lm_eval's CLI)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ANY_PORT, RESULTS, machine_record, read_results, write_results

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "bench" / "lm_eval_tasks"
MC_TASK, GEN_TASK = "slotserve_facts_mc", "slotserve_facts_gen"
LOGLIKELIHOOD_TOLERANCE = 1e-3
"""fp32 agreement the issue asks of every request's loglikelihood (slotserve vs HFLM)."""


def hf_model_args(model: str) -> dict:
    """HFLM's arguments for ``model`` (an alias such as ``smollm2-135m``, a
    ``.gguf`` file or a HF folder): ``pretrained`` and, for a GGUF,
    ``gguf_file``; fp32 on the CPU, one request per forward."""
    from worker.models.checkpoint import resolve_model_path

    path, gguf_file = resolve_model_path(model)
    args = {"pretrained": path, "dtype": "float32", "device": "cpu", "batch_size": 1}
    if gguf_file:
        args["gguf_file"] = gguf_file
    return args


def write_tokenizer(model: str, folder: str) -> str:
    """The tokenizer of ``model`` saved to ``folder`` (``save_pretrained``), for
    lm-eval's API models, which load a tokenizer by folder name; returns ``folder``."""
    from transformers import AutoTokenizer

    from worker.models.checkpoint import resolve_model_path

    path, gguf_file = resolve_model_path(model)
    AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {})).save_pretrained(folder)
    return folder


def start_server(model: str, slots: int):
    """A LocalCluster (broker, one worker serving ``model`` with ``slots`` slots,
    the gateway on a free port) whose ``/health`` answers 200; the caller stops it."""
    import httpx

    from broker import BrokerConfig
    from gateway import GatewayConfig
    from slotserve.launcher import ClusterConfig, LocalCluster
    from worker.config import WorkerConfig

    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT), (WorkerConfig(model=model, num_slots=slots),),
                        start_timeout_s=300.0, gateway=GatewayConfig(port=0))
    cluster = LocalCluster(cfg)
    cluster.start()
    try:
        deadline = time.monotonic() + 60  # start() returned once the worker registered; the gateway polls status
        while httpx.get(cluster.http_url + "/health", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become healthy within 60 s")
            time.sleep(0.05)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def slotserve_models(url: str, model: str, tokenizer: str, concurrency: int) -> dict[str, tuple[str, dict]]:
    """lm-eval model names and arguments for the server at ``url`` serving
    ``model``: ``local-completions`` (token-id prompts, ``tokenizer`` a folder)
    for the loglikelihood task, ``local-chat-completions`` for the chat task;
    ``concurrency`` requests in flight (the server batches them into slots)."""
    common = {"model": model, "num_concurrent": concurrency, "max_retries": 1, "timeout": 600}
    return {
        MC_TASK: ("local-completions", {**common, "base_url": url + "/v1/completions", "tokenizer": tokenizer,
                                        "tokenizer_backend": "huggingface", "tokenized_requests": True}),
        GEN_TASK: ("local-chat-completions", {**common, "base_url": url + "/v1/chat/completions"}),
    }


def evaluate(model, model_args: dict | None, task: str, *, limit: int | None) -> dict:
    """One lm-eval run of ``task`` (``model``: a registered name with
    ``model_args``, or an LM instance): ``{"results": task's metrics, "samples":
    per-document records, "wall_s"}``. The chat task gets the chat template."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(ROOT)  # the YAMLs' data_files are relative to the repository root
    try:
        t0 = time.monotonic()
        tasks = TaskManager(include_path=str(TASKS), include_defaults=False)  # not lm-eval's own ~200 folders
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                                      limit=limit, log_samples=True, apply_chat_template=task == GEN_TASK,
                                      bootstrap_iters=0)
        wall_s = time.monotonic() - t0
    finally:
        os.chdir(cwd)
    return {"results": out["results"][task], "samples": sorted(out["samples"][task], key=lambda s: s["doc_id"]),
            "wall_s": wall_s}


def loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], float]:
    """``(doc_id, choice index) -> loglikelihood`` of a multiple_choice run's samples."""
    return {(s["doc_id"], i): float(resp[0]) for s in samples for i, resp in enumerate(s["filtered_resps"])}


def compare_mc(ours: dict, theirs: dict) -> dict:
    """slotserve's multiple_choice run against HFLM's: requests compared, the
    max absolute loglikelihood difference (and where), questions whose
    ``acc`` / ``acc_norm`` differ, both accuracies. Raises ValueError when the
    runs did not score the same requests."""
    a, b = loglikelihoods(ours["samples"]), loglikelihoods(theirs["samples"])
    if a.keys() != b.keys():
        raise ValueError(f"the runs scored different requests: {sorted(a.keys() ^ b.keys())[:5]}")
    worst = max(a, key=lambda k: abs(a[k] - b[k]))
    by_doc = {s["doc_id"]: s for s in theirs["samples"]}
    differing = [s["doc_id"] for s in ours["samples"]
                 if (s["acc"], s["acc_norm"]) != (by_doc[s["doc_id"]]["acc"], by_doc[s["doc_id"]]["acc_norm"])]
    return {"requests": len(a), "questions": len(by_doc), "max_abs_diff": abs(a[worst] - b[worst]),
            "worst_request": {"doc_id": worst[0], "choice": worst[1], "slotserve": a[worst], "hf": b[worst]},
            "differing_predictions": differing,
            "acc": {"slotserve": ours["results"]["acc,none"], "hf": theirs["results"]["acc,none"]},
            "acc_norm": {"slotserve": ours["results"]["acc_norm,none"], "hf": theirs["results"]["acc_norm,none"]}}


def compare_gen(ours: dict, theirs: dict) -> dict:
    """slotserve's chat run against HFLM's: questions whose reply text differs
    (with both replies), both accuracies."""
    by_doc = {s["doc_id"]: s for s in theirs["samples"]}
    if by_doc.keys() != {s["doc_id"] for s in ours["samples"]}:
        raise ValueError("the runs answered different questions")
    differing = [{"doc_id": s["doc_id"], "slotserve": s["filtered_resps"][0],
                  "hf": by_doc[s["doc_id"]]["filtered_resps"][0]}
                 for s in ours["samples"] if s["filtered_resps"][0] != by_doc[s["doc_id"]]["filtered_resps"][0]]
    return {"questions": len(by_doc), "differing_replies": differing,
            "acc": {"slotserve": ours["results"]["acc,none"], "hf": theirs["results"]["acc,none"]},
            "examples": [{"doc_id": s["doc_id"], "reply": s["filtered_resps"][0]} for s in ours["samples"][:3]]}


def run(model: str, *, limit: int | None = None, slots: int = 4, served_name: str | None = None) -> dict:
    """Both tasks through slotserve (``model`` served with ``slots`` slots, as
    many requests in flight), then through HFLM; returns the comparison
    (``mc``, ``gen``) with each run's wall time."""
    from lm_eval.models.huggingface import HFLM

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="slotserve-lmeval-tok-") as tok:
        write_tokenizer(model, tok)
        cluster = start_server(model, slots)
        try:
            for task, (name, args) in slotserve_models(cluster.http_url, served_name or model, tok, slots).items():
                runs[("slotserve", task)] = evaluate(name, args, task, limit=limit)
        finally:
            cluster.stop()
    hf = HFLM(**hf_model_args(model))
    for task in (MC_TASK, GEN_TASK):
        runs[("hf", task)] = evaluate(hf, None, task, limit=limit)
    wall = {f"{who} {task}": round(r["wall_s"], 1) for (who, task), r in runs.items()}
    return {"mc": compare_mc(runs[("slotserve", MC_TASK)], runs[("hf", MC_TASK)]),
            "gen": compare_gen(runs[("slotserve", GEN_TASK)], runs[("hf", GEN_TASK)]), "wall_s": wall}


def print_table(res: dict) -> None:
    mc, gen = res["mc"], res["gen"]
    before, after = res["machine"]["load_avg_before_after"]
    print(f"\nlm-eval {res['config']['lm_eval']} on {res['config']['model']} (fp32), "
          f"{mc['questions']} questions, load average {before:.1f}-{after:.1f}")
    print("| task | lm-eval model | slotserve | hf | agreement |")
    print("|---|---|---|---|---|")
    print(f"| {MC_TASK} acc | local-completions | {mc['acc']['slotserve']:.4f} | {mc['acc']['hf']:.4f} | "
          f"{mc['requests']} loglikelihoods, max abs diff {mc['max_abs_diff']:.2e}; "
          f"{mc['questions'] - len(mc['differing_predictions'])}/{mc['questions']} same choices |")
    print(f"| {MC_TASK} acc_norm | local-completions | {mc['acc_norm']['slotserve']:.4f} | "
          f"{mc['acc_norm']['hf']:.4f} | |")
    print(f"| {GEN_TASK} acc | local-chat-completions | {gen['acc']['slotserve']:.4f} | {gen['acc']['hf']:.4f} | "
          f"{gen['questions'] - len(gen['differing_replies'])}/{gen['questions']} identical replies |")
    print("wall s: " + ", ".join(f"{k} {v}" for k, v in res["wall_s"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF folder (default smollm2-135m)")
    ap.add_argument("--limit", type=int, default=None, help="first N questions only (default: all 64)")
    ap.add_argument("--slots", type=int, default=4, help="worker slots, and lm-eval's concurrent requests")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--write-tokenizer", metavar="DIR", default=None,
                    help="write the model's tokenizer to DIR (the tokenizer= of lm_eval's local-completions) and exit")
    args = ap.parse_args(argv)
    if args.write_tokenizer:
        print(write_tokenizer(args.model, args.write_tokenizer))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the cluster
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from importlib.metadata import version

    machine = machine_record()
    res = {"config": {"model": args.model, "limit": args.limit, "slots": args.slots, "lm_eval": version("lm_eval"),
                      "tolerance": LOGLIKELIHOOD_TOLERANCE}}
    res.update(run(args.model, limit=args.limit, slots=args.slots))
    ok = res["mc"]["max_abs_diff"] <= LOGLIKELIHOOD_TOLERANCE and not res["mc"]["differing_predictions"] \
        and res["mc"]["acc"]["slotserve"] == res["mc"]["acc"]["hf"] and res["gen"]["acc"]["slotserve"] == \
        res["gen"]["acc"]["hf"]
    res["agree"] = ok
    stem = "lmeval" if args.model == "smollm2-135m" else f"lmeval_{Path(args.model).name}"
    path = write_results(args.out / f"{stem}.json", res, machine)
    print_table(read_results(path))
    print(f"{'agree' if ok else 'DISAGREE'}; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
