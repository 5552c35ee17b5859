"""Text benchmark: what following a request's text costs the engine, per token.

    python -m bench.text [--repeats N]

Prints a table and saves bench/results/text.json and bench/results/text.png.

A worker whose model has a tokenizer streams every request's text (token-id
prompts too), and requests with text stop strings are matched character by
character (worker/text.py). This measures that cost with SmolLM2-135M's own
tokenizer (49,152 tokens, byte-level BPE) and a zero-cost model that replays
the tokens of a real text (English and Python, emoji and CJK included, so
some characters arrive split over byte tokens), batch 8, 256 requests x 128
tokens, in four cases:

- ``no text``: the model without a tokenizer (what the engine did for
  token-id prompts before: nothing);
- ``text``: every request streams its text (``on_text``), as the worker does;
- ``text + 4 stops``: and four stop strings that never match;
- ``text + 16 stops``: the most a request may give (MAX_STOP_STRINGS).

The overhead per generated token is (case time - ``no text`` time) / tokens,
in microseconds of this process's CPU time (median of ``--repeats``
samples). For scale it is compared with SmolLM2's decode step on this
machine (bench/results/model.json: ``limits.decode_step_ms`` for a batch of
8, i.e. per token per slot); the ``>= 5x naive`` target of bench/engine.py
is not affected (its model has no tokenizer, and requests without text pay
nothing for it: tests/worker/test_text_stops.py and bench/engine.py check that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import RESULTS, load_avg, machine_record, write_results  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number 😀 (日本語のコメント).\"\"\"\n"
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "The quick brown fox jumps over the lazy dog; naïve café résumé — ünïcödé 🚀✨.\n") * 4
BATCH, REQUESTS, MAX_TOKENS, PROMPT = 8, 256, 128, [1, 2, 3, 4]
NEVER = ["<|never|>", "STOP HERE", "###", "\n\n\n\n", "🛑", "END OF TEXT", "Observation:", "</answer>",
         "zzzz", "qqqq", "xxxx", "@@@@", "%%%%", "^^^^", "~~~~", "````````"]


class Replay:
    """A zero-cost model that writes ``TEXT`` (its tokens, in order); ``tokenizer`` optional."""

    def __init__(self, tokens: list[int], tokenizer=None) -> None:
        self.script = tokens
        if tokenizer is not None:
            self.tokenizer = tokenizer

    def next_tokens(self, sequences):
        n, script = len(self.script), self.script
        return [script[(len(s) - len(PROMPT)) % n] for s in sequences]


def sample(codec, tokens: list[int], case: str) -> float:
    model = Replay(tokens, None if case == "no text" else codec)
    engine = BatchInferenceEngine(model, batch_size=BATCH)
    stops = {"text + 4 stops": NEVER[:4], "text + 16 stops": NEVER}.get(case, [])
    sink = [].append
    t0 = time.process_time()
    for _ in range(REQUESTS):
        if case == "no text":
            engine.submit_request(PROMPT, MAX_TOKENS)
        else:
            engine.submit_request(PROMPT, MAX_TOKENS, on_text=sink, stop=stops)
    engine.run()
    return time.process_time() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="samples per case (default 5)")
    args = ap.parse_args(argv)
    machine = machine_record()

    from transformers import AutoTokenizer

    from worker.models.checkpoint import resolve_model_path
    from worker.models.hf_text import HFTextCodec

    path, gguf = resolve_model_path("smollm2-135m")
    codec = HFTextCodec(AutoTokenizer.from_pretrained(path, gguf_file=gguf))
    tokens = codec.encode(TEXT)
    cases = ["no text", "text", "text + 4 stops", "text + 16 stops"]
    load_before = load_avg()
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):  # interleaved: a burst of other work hits every case alike
        for c in cases:
            times[c].append(sample(codec, tokens, c))
    load_after = load_avg()
    n_tokens = REQUESTS * MAX_TOKENS
    base = statistics.median(times["no text"])
    step_ms = None
    model_json = RESULTS / "model.json"
    if model_json.exists():
        step_ms = json.loads(model_json.read_text()).get("limits", {}).get("decode_step_ms")
    rows = []
    print(f"Text cost: SmolLM2 tokenizer, zero-cost replay model, batch {BATCH}, {REQUESTS} requests x "
          f"{MAX_TOKENS} tokens, median of {args.repeats} (load {load_before:.2f} -> {load_after:.2f})")
    print(f"{'case':>16} {'CPU s':>8} {'us/token':>9} {'overhead us/token':>18} {'% of a SmolLM2 token':>21}")
    for c in cases:
        t = statistics.median(times[c])
        over = (t - base) / n_tokens * 1e6
        share = None if step_ms is None else over / (step_ms * 1000 / BATCH) * 100
        rows.append({"case": c, "cpu_s": round(t, 4), "us_per_token": round(t / n_tokens * 1e6, 3),
                     "overhead_us_per_token": round(over, 3),
                     "overhead_pct_of_smollm2_token": None if share is None else round(share, 4)})
        print(f"{c:>16} {t:8.3f} {t / n_tokens * 1e6:9.3f} {over:18.3f} "
              f"{'-' if share is None else f'{share:.3f} %':>21}")
    if step_ms is not None:
        print(f"(SmolLM2 decode step {step_ms} ms for a batch of {BATCH}: {step_ms * 1000 / BATCH:,.0f} us per token)")
    out = {"batch": BATCH, "requests": REQUESTS, "max_tokens": MAX_TOKENS, "repeats": args.repeats,
           "tokenizer": "smollm2-135m", "smollm2_decode_step_ms": step_ms, "cases": rows,
           "samples_s": times, "load_avg_before_after": [load_before, load_after]}
    write_results(RESULTS / "text.json", out, machine)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh([r["case"] for r in rows], [r["us_per_token"] for r in rows], color="tab:blue")
    ax.set_xlabel("engine CPU time per generated token (us)")
    ax.set_title("Following a request's text (SmolLM2 tokenizer, batch 8)")
    fig.tight_layout()
    fig.savefig(RESULTS / "text.png", dpi=100)
    print(f"saved {RESULTS / 'text.json'} and {RESULTS / 'text.png'}")


if __name__ == "__main__":
    main()
