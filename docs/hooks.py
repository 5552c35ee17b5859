"""MkDocs hook: the parts of the docs that are generated, so they cannot drift.

A page asks for a generated block with a line of its own,
``<!-- generated: NAME -->``; :func:`on_page_markdown` replaces it with the
Markdown of ``GENERATORS[NAME]``. An unknown name, a field without its
comment, or a results file whose shape a renderer does not know fails the
build (``PluginError``), which ``mkdocs build --strict`` in CI turns into a
red run instead of a stale page.

- ``request_parameters``: the table of a request's parameters, read from
  their one declaration (the fields of :class:`protocol.request.RequestParams`:
  name, type, default, and the comment under each field).
- ``metrics``: the Prometheus series, from the docstrings of
  :mod:`broker.metrics` and :mod:`gateway.metrics` (the lists kept next to
  the code that exports them).
- ``bench_*``: the tables of ``bench/results/*.json``, one renderer per
  results file; ``bench_files`` lists every results file, so a new one shows
  up even before it has a renderer. The PNG plots beside them are served
  under ``results/``.

The project is imported as installed (``pip install -e .``; in a worktree
whose editable install points elsewhere, set ``PYTHONPATH`` to the checkout).
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import statistics
import tokenize
from pathlib import Path
from typing import Any, Callable

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

_MARKER = re.compile(r"^<!-- generated: ([a-z0-9_]+) -->[ \t]*$", re.M)

GENERATORS: dict[str, Callable[[Path], str]] = {}
"""name -> a function of the repository root returning Markdown (filled in below)."""
_BENCH_FILES: dict[str, str] = {}
"""results file name -> the title of the benchmarks page's section that shows it."""


# --------------------------------------------------------------------------- MkDocs events


def on_files(files, config):
    """Serve ``bench/results/*.png`` as ``results/<name>.png`` (the benchmarks page shows them)."""
    for png in sorted(_results_dir(config).glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = _root(config)

    def replace(match: re.Match) -> str:
        name = match.group(1)
        generate = GENERATORS.get(name)
        if generate is None:
            raise PluginError(f"{page.file.src_path}: no generator {name!r} in docs/hooks.py "
                              f"(known: {sorted(GENERATORS)})")
        return generate(root)

    return _MARKER.sub(replace, markdown)


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _results_dir(config) -> Path:
    return _root(config) / "bench" / "results"


# --------------------------------------------------------------------------- request parameters


def request_parameters(root: Path) -> str:
    """One row per field of ``RequestParams``, in declaration (= wire) order."""
    from protocol import request

    params = request.RequestParams
    declaring = next((c for c in params.__mro__ if set(params._fields) <= set(c.__dict__.get("__annotations__", {}))),
                     None)
    if declaring is None:
        raise PluginError("request_parameters: no class in RequestParams' bases declares its fields")
    fields = _field_comments(declaring)
    missing = [name for name in params._fields if not fields.get(name, ("", ""))[1]]
    if missing:
        raise PluginError(f"request_parameters: field(s) {missing} of {declaring.__qualname__} have no comment "
                          "under their declaration; that comment is the documentation")
    names = set(params._fields) | {n for n in vars(request) if not n.startswith("_")}
    constants = {name: value for name, value in vars(request).items()
                 if re.fullmatch(r"[A-Z][A-Z0-9_]+", name) and type(value) in (int, float, str)}
    rows = ["| parameter | type (as normalised) | default | meaning |", "|---|---|---|---|"]
    for name in params._fields:
        type_text, comment = fields[name]
        default = params._field_defaults.get(name, _REQUIRED)
        shown = "(required)" if default is _REQUIRED else f"`{default!r}`"
        rows.append(f"| `{name}` | `{type_text}` | {shown} | {_prose(comment, names, constants)} |")  # (| in code is kept)
    aliases = ", ".join(f"`{a}` for `{f}`" for a, f in request.ROW_ALIASES.items())
    return "\n".join(rows) + f"\n\nOther names a JSONL row may use: {aliases}.\n"


_REQUIRED = object()


def _field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (annotation's type as written, the comment lines under it)}`` from ``cls``'s source."""
    source = inspect.getsource(cls)
    body = ast.parse(source).body[0].body  # (source is the class alone; lines are counted within it)
    fields = [node for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    comments = [(tok.start[0], tok.string.lstrip("#").strip())
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    out = {}
    for i, node in enumerate(fields):
        end = fields[i + 1].lineno if i + 1 < len(fields) else float("inf")
        text = " ".join(c for line, c in comments if node.end_lineno < line < end)
        annotation = node.annotation
        if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Annotated":
            annotation = annotation.slice.elts[0]  # Annotated[type, check]: the type
        out[node.target.id] = (ast.unparse(annotation), text)
    return out


_CODE = re.compile(r"\b(?:(?:protocol|worker|broker|client|gateway|slotserve)(?:[./]\w+)+|[A-Z]\w{3,}|"
                   r"[a-z]+(?:_[a-z]+)+|None|True|False)\b")


def _prose(comment: str, names: set[str], constants: dict[str, Any]) -> str:
    """A field's comment as a table cell: identifiers, module paths, constants (with their value) in code."""
    def code(match: re.Match) -> str:
        word = match.group(0)
        if word in constants:
            return f"`{word}` (`{constants[word]!r}`)" if type(constants[word]) is str else f"`{word}` ({constants[word]})"
        if word[0].isupper() and word not in names and word not in ("None", "True", "False"):
            return word  # an ordinary capitalised word (OpenAI, Hermes, JSON), not a name of the module
        return f"`{word}`"
    return _CODE.sub(code, _cell(comment))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


# --------------------------------------------------------------------------- metrics


def metrics(root: Path) -> str:
    """The bullet lists of broker.metrics' and gateway.metrics' docstrings."""
    from broker import metrics as broker_metrics
    from gateway import metrics as gateway_metrics

    parts = []
    for title, module in (("Broker (`slotserve broker --metrics-port PORT`, `/metrics`)", broker_metrics),
                          ("Gateway (`slotserve serve`, `GET /metrics`)", gateway_metrics)):
        doc = inspect.getdoc(module) or ""
        start = doc.find("\n- ")
        if start < 0:
            raise PluginError(f"metrics: {module.__name__}'s docstring has no list of series")
        parts.append(f"**{title}**\n\n" + _rst_to_md(doc[start + 1:]))
    return "\n\n".join(parts) + "\n"


def _rst_to_md(text: str) -> str:
    text = re.sub(r":\w+:`~?([\w.]+?)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


# --------------------------------------------------------------------------- benchmarks


def _results(root: Path, name: str) -> dict:
    path = root / "bench" / "results" / name
    if not path.exists():
        raise PluginError(f"bench results {path} missing: run the benchmark or drop its block from the docs")
    return json.loads(path.read_text())


def _bench(name: str, title: str) -> Callable[[Callable[[dict], str]], Callable[[Path], str]]:
    """Register a renderer of ``bench/results/<name>``, shown under the benchmarks page's section
    ``title``; a results file of another shape fails the build."""
    def wrap(render: Callable[[dict], str]) -> Callable[[Path], str]:
        def generate(root: Path) -> str:
            data = _results(root, name)
            try:
                machine = _machine_line(data)
                return (render(data).rstrip() + (f"\n\n{machine}" if machine else "")
                        + f"\n\n<small>From `bench/results/{name}`.</small>\n")
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise PluginError(f"bench/results/{name} does not have the shape docs/hooks.py "
                                  f"{render.__name__} renders ({type(e).__name__}: {e}); update one of them") from e
        generate.__name__ = render.__name__
        GENERATORS[render.__name__] = generate
        _BENCH_FILES[name] = title
        return generate
    return wrap


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.1f}".rstrip("0").rstrip(".") if v != int(v) else f"{v:.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return _cell(str(v))


def _load(*values: Any) -> str:
    """A load average (or a few, before/after) as ``1.3-2.0``."""
    flat = []
    for v in values:
        if isinstance(v, (list, tuple)):
            flat += [x for x in v if isinstance(x, (int, float))]
        elif isinstance(v, (int, float)):
            flat.append(v)
    if not flat:
        return "not recorded"
    lo, hi = min(flat), max(flat)
    return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f}"


def _uptime_load(uptime: str | None) -> float | None:
    """The 1-minute load average of an ``uptime`` line."""
    match = re.search(r"load average: ([0-9.]+)", uptime or "")
    return float(match.group(1)) if match else None


def _first(x: Any) -> Any:
    """The 1-minute value of a load average saved as a number or a 1/5/15-minute triple."""
    return x[0] if isinstance(x, (list, tuple)) and x else x


def _run_load(d: dict) -> str:
    """A whole run's load average, before-after, under any of the names results files use
    (bench.common's ``machine.load_avg_before_after``, and the older ones it reads)."""
    m = d.get("machine")
    if isinstance(m, dict):
        if m.get("load_avg_before_after"):
            return _load(m["load_avg_before_after"])
        if "loadavg_at_start" in m:
            return _load(_first(m["loadavg_at_start"]), _first(m.get("loadavg_at_end")))
    for before, after in (("load_avg_before", "load_avg_after"), ("load_before", "load_after")):
        if before in d:
            return _load(_first(d[before]), _first(d.get(after)))
    if isinstance(d.get("load_avg_before_after"), list):
        return _load(d["load_avg_before_after"])
    return "not recorded"


def _row_load(r: dict) -> str:
    """One row's (one system's, one run's) load average, under any of the names rows use."""
    for key in ("load_avg_before_after", "load_avg"):
        if isinstance(r.get(key), list):
            return _load(r[key])
    if "load_before" in r:
        return _load(_first(r["load_before"]), _first(r.get("load_after")))
    if "loadavg" in r:
        return _load(_first(r["loadavg"]))
    return _load(_uptime_load(r.get("uptime_before")))


def _machine_line(d: dict) -> str:
    """The machine a results file records (bench.common's ``machine`` record), as a sentence; "" if none."""
    m = d.get("machine")
    if not isinstance(m, dict) or not m.get("cpu_model"):
        return ""
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    date = f", {m['date']} UTC" if m.get("date") else ""
    return f"Machine: {m['cpu_model']}{cores}{date}; load {_run_load(d)}."


def _hf_model_systems(d: dict) -> str:
    """bench.model's systems table (HE32 and the like)."""
    ratios = d.get("ratios", {})
    rows = []
    for s in d["systems"]:
        r = ratios.get(s["system"], {})
        agreement = f"{s['identical_to_hf_greedy']}/{len(d['reference_useful_lengths']['lengths'])}"
        if s.get("median_first_divergence") is not None:
            agreement += f" (token {s['median_first_divergence']:g})"
        rss = s.get("rss_mb")
        if rss is not None and s.get("peak_rss_mb") is not None:
            rss = f"{rss:,} ({s['peak_rss_mb']:,})"
        rows.append([f"`{s['system']}`", s["tokens_per_s"], s["ttft_p50_ms"], s["tpot_mean_ms"], agreement, rss,
                     r.get("hf-static"), r.get("llamacpp"), _row_load(s)])
    out = _table(["system", "tokens/s", "TTFT p50 ms", "TPOT mean ms",
                  "identical to HF greedy (median first divergence)", "RSS MiB (peak)", "vs HF static",
                  "vs llama.cpp", "load"], rows)
    steps = d.get("decode_step_ms")
    if steps:
        sizes = sorted({int(k) for v in steps.values() for k in v})
        out += "\n\nDecode step (ms) at " + " / ".join(map(str, sizes)) + " slots, per precision:\n\n"
        out += _table(["precision", *(f"{n} slots" for n in sizes)],
                      [[f"`{p}`", *(v.get(str(n)) for n in sizes)] for p, v in steps.items()])
    if d.get("ideal_wall_s"):
        out += (f"\n\nForward-pass limit of the fp32 runner ({d.get('limits_threads')} threads): "
                f"HE32 in {d['ideal_wall_s']:g} s at best.")
    return out


@_bench("model.json", "SmolLM2-135M on HE32")
def bench_model(d: dict) -> str:
    return _hf_model_systems(d)


@_bench("model_gemma3-270m.json", "Gemma 3 270M on HE32")
def bench_model_gemma(d: dict) -> str:
    return _hf_model_systems(d)


def _served(d: dict) -> str:
    """bench.model's per-model table of the served systems (``served``): the Qwen GGUFs' tables."""
    llama = next((s["tokens_per_s"] for s in d["served"] if s["system"] == "llamacpp"), None)
    rows = [[f"`{s['system']}`", s["threads"], s["tokens_per_s"],
             f"{s['tokens_per_s'] / llama:.2f}x" if llama else None, s["worker_rss_mib"],
             f"{s['identical_to_reference']}/{s['requests']}", s["start_to_ready_s"], s["step_weights_mib"]]
            for s in d["served"]]
    return _table(["system", "threads", "tokens/s", "vs llama.cpp", "worker RSS MiB",
                   f"identical to {d['served'][0]['reference']}", "start to ready s", "weights MiB/step"], rows)


@_bench("model_qwen2.5-coder-0.5b.json", "Qwen2.5-Coder 0.5B and 1.5B on HE32")
def bench_model_qwen05(d: dict) -> str:
    return _served(d)


@_bench("model_qwen2.5-coder-1.5b.json", "Qwen2.5-Coder 0.5B and 1.5B on HE32")
def bench_model_qwen15(d: dict) -> str:
    return _served(d)


@_bench("model_smollm2_gguf.json", "SmolLM2-135M on HE32")
def bench_model_smollm2_gguf(d: dict) -> str:
    return _served(d)


def _random_cases(d: dict) -> str:
    rows = []
    for case in d["cases"]:
        tps = {s["system"]: s["tokens_per_s"] for s in case["systems"] if "tokens_per_s" in s}  # (not skipped)
        if not tps:
            continue
        vs = case.get("slotserve_vs", {})
        rows.append([f"`{case['shape']}`", case["dtype"], case["workload"], case["slots"], tps.get("slotserve"),
                     tps.get("hf-static"), tps.get("hf-cb"), vs.get("hf-static"), vs.get("hf-cb")])
    device = d["device"] + (f" ({d['gpu']})" if d.get("gpu") else "")
    return (_table(["shape", "dtype", "workload", "slots", "slotserve tokens/s", "HF static", "transformers CB",
                    "vs HF static", "vs CB"], rows)
            + f"\n\n{device}, {d['threads']} thread(s), torch {d.get('torch', '?')}, "
              f"load {_run_load(d)}.")


@_bench("model_random_cpu.json", "Larger shapes, random weights")
def bench_model_random(d: dict) -> str:
    return _random_cases(d)


@_bench("model_random_cpu_threads1.json", "Larger shapes, random weights")
def bench_model_random_threads1(d: dict) -> str:
    return _random_cases(d)


@_bench("model_random_cuda.json", "Larger shapes, random weights")
def bench_model_random_cuda(d: dict) -> str:
    return _random_cases(d)


@_bench("model_random_cuda_gemma_he32.json", "Larger shapes, random weights")
def bench_model_random_cuda_2(d: dict) -> str:
    return _random_cases(d)


@_bench("roofline.json", "Roofline")
def bench_roofline(d: dict) -> str:
    return _roofline(d)


def _roofline(d: dict) -> str:
    """bench/roofline.py's fp32 kinds and HE32 floor (every roofline results file has them)."""
    rows_n = sorted({int(n) for k in d["kinds"].values() for n in k["ms"]})
    gb_n = sorted({int(n) for k in d["kinds"].values() for n in k.get("implied_gb_s", {})})
    rows = [[f"`{kind}`", *(v["ms"].get(str(n)) for n in rows_n), *(v.get("implied_gb_s", {}).get(str(n)) for n in gb_n),
             v.get("gflop_s_512")] for kind, v in d["kinds"].items()]
    f = d["he32_floor"]
    return (_table(["linear kind", *(f"ms at {n} rows" for n in rows_n), *(f"GB/s read at {n}" for n in gb_n),
                    "GFLOP/s at 512"], rows)
            + f"\n\nThe {d['model_shape']} layers' linears ({d['layer_weight_mb']:g} MB of weights), "
              f"{d['threads']} threads. Streaming reads {d['read_gb_s']:g} GB/s, fp32 GEMM peak "
              f"{d['fp32_gemm_gflop_s']:g} GFLOP/s: HE32's floor is {f['total_s']:g} s (prefill {f['prefill_s']:g} s "
              f"at the peak, {f['decode_steps']:g} decode steps {f['decode_step_bound']}-bound at "
              f"{f['decode_step_ms']:g} ms). Load {_run_load(d)}.")


@_bench("roofline_avx2.json", "Roofline")
def bench_roofline_avx2(d: dict) -> str:
    peak = d["int8_peak"]
    st = d["stream"]
    rows = []
    for model, by_precision in d["decode_floor"].items():
        g = by_precision["gguf"]
        rows.append([f"`{model}`", f"{g['weight_mb']:,.1f}", g["floor_ms"], f"{g['macs_per_row'] / 1e9:.2f}",
                     g["compute_floor_ms"], f"{g['compute_floor_ms'] / g['floor_ms']:.2f}x"])
    rows_n = rows and d["decode_floor"][next(iter(d["decode_floor"]))]["gguf"]["rows"]
    return (_roofline(d) + "\n\n"
            + _table(["model (gguf)", "weights a step reads, MiB", "memory floor ms", "GMAC a row",
                      f"int8 compute floor at {rows_n} rows, ms", "compute / memory"], rows)
            + f"\n\nStreaming reads {st['read_gb_s']:g} GB/s on {st['threads']} threads ({st['tensor_mib']} MiB "
              f"tensor); int8 multiply-add peak {peak['gmac_s']:g} GMAC/s ({peak['instruction']}, "
              f"{peak['per_thread_gmac_s']:g} a thread).")


@_bench("fim.json", "Fill in the middle")
def bench_fim(d: dict) -> str:
    systems = d["systems"]
    names = list(systems)
    rows = []
    for name in names:
        r = systems[name]
        other = systems[names[1 - names.index(name)]]["cases"] if len(names) == 2 else None
        same = sum(a["completion"] == b["completion"] for a, b in zip(r["cases"], other)) if other else None
        rows.append([name, f"{r['passes']}/{d['cases']}", same, f"{r['ttft_first_median_ms'] / 1000:.1f} s",
                     f"{r['ttft_keystroke_median_ms'] / 1000:.2f} s", f"{r['ttft_ratio']:.1f}x"])
    return (_table(["system", "passes", "same completion", "TTFT first (median)", "TTFT keystroke (median)",
                    "ratio"], rows)
            + f"\n\n`{d['model']}`, {d['cases']} cases, `n_predict` {d['n_predict']}, {d['threads']} thread(s); "
            f"{d['files']} files x {d['keys']} keystrokes. Load {_run_load(d)}.")


@_bench("embeddings.json", "Embeddings")
def bench_embeddings(d: dict) -> str:
    ratios = d.get("ratios", {})
    rows = [[name, f"{rate:,.1f}", f"{statistics.median(d['seconds'][name]):.2f} s",
             f"{ratios[name]:.2f}x" if name in ratios else None]
            for name, rate in d["sentences_per_s"].items()]
    return (_table(["system", "sentences/s (median)", "seconds per batch (median)", "vs sentence-transformers"],
                   rows)
            + "\n\n" + f"Ratio slotserve / sentence-transformers {d['ratio']:.2f} (target >= {d['target_ratio']}); "
            f"largest difference between their vectors {d['max_abs_diff']:.1e} "
            f"(target <= {d['target_max_abs_diff']:g}). "
            f"`{d['model']}`, {d['sentences']:,} sentences ({d['tokens']:,} tokens), {d['slots']} slots, "
            f"{d['threads']} threads, {d['rounds']} rounds; {d['path']}. Load {_run_load(d)}.")


@_bench("prefix.json", "Prefix caching")
def bench_prefix(d: dict) -> str:
    def row(r: dict) -> list[Any]:
        peak = r.get("memory", {}).get("rss_peak_mb", [])
        used = [r["cache_mb_used"]] if "cache_mb_used" in r else [w["used_mb"] for w in
                                                                   r.get("workers_prefix_cache", {}).values()]
        return [r["system"], f"{_fmt(r['ttft_p50_ms'] / 1000)} / {_fmt(r['ttft_p99_ms'] / 1000)}",
                r.get("output_tokens_per_s"),
                f"{r['prompt_tokens_prefilled']:,} of {r['prompt_tokens']:,}" if "prompt_tokens" in r else None,
                r.get("hit_rate"), ", ".join(f"{u:,.0f}" for u in used) or None,
                ", ".join(f"{p:,.0f}" for p in peak) or None,
                _row_load(r)]
    a, b = d["A"], d["B"]
    rows = [row(r) for r in a["rows"] + a["alone"] + b["rows"]]
    return (_table(["system", "TTFT p50 / p99 (s)", "output tok/s", "prompt tokens prefilled", "hit rate",
                    "cache used MiB", "peak RSS MiB", "load"], rows)
            + f"\n\nCache budget: {a['cache_mb']:g} MiB in A, {b['cache_mb_per_worker']:g} MiB per worker in B."
            + f"\n\nA: TTFT p50 lower with the cache by "
              + ", ".join(f"{v}x at {t} thread(s)" for t, v in a["ttft_p50_speedup"].items())
              + "; one request at a time by "
              + ", ".join(f"{v}x at {t}" for t, v in a["alone_ttft_p50_speedup"].items())
              + "; outputs identical with and without the cache: "
              + ", ".join(f"{v}/{a['prompts']} at {t} thread(s)" for t, v in a["identical_outputs"].items())
              + f"; `{a['tokens_per_s_vs_llamacpp']['slotserve']}` gave {a['tokens_per_s_vs_llamacpp']['ratio']}x "
                f"llama.cpp's tokens/s. B: hit rate against 1 worker's: "
              + ", ".join(f"{k} {v}x" for k, v in b["hit_rate_vs_1_worker"].items()) + ".")


@_bench("prefill.json", "Chunked prefill")
def bench_prefill(d: dict) -> str:
    rows = [[r["max_prefill_tokens"] if r["chunked"] else "unchunked", r["short_worst_itl_ms"], r["long_ttft_ms"],
             r["short_mean_tpot_ms"], _row_load(r)] for r in d["rows"]]
    return (_table(["`--max-prefill-tokens`", "decoding requests' worst ITL ms", "long prompt's TTFT ms",
                    "decoding requests' mean TPOT ms", "load"], rows)
            + f"\n\n{d['model']} {d['precision']}, {d['threads']} threads: a {d['long_prompt_tokens']:,}-token prompt "
              f"arrives beside {d['short_requests']} decoding requests.")


@_bench("engine.json", "Engine")
def bench_engine(d: dict) -> str:
    k = d["bookkeeping"]
    rows = [[r["prompt_len"], r["engine"]["end_to_end_tok_s_median"] / 1e6, r["naive"]["end_to_end_tok_s_median"] / 1e6,
             r["ratio_end_to_end_median"], r["ratio_run_loop_median"]] for r in k["rows"]]
    out = (f"Bookkeeping: a zero-cost model, batch {k['batch_size']}, {k['num_requests']:,} requests x "
           f"{k['max_tokens']} tokens, median of {k['repeats']}:\n\n"
           + _table(["prompt tokens", "engine M tok/s (end to end)", "naive M tok/s", "vs naive, end to end",
                     "vs naive, `run()` only"], rows))
    b = d["batching"]
    modes = [[f"`{m}`", v["throughput_tok_s"], v["occupancy_while_waiting"], v["iterations"]]
             for m, v in b["modes"].items()]
    out += (f"\n\nBatching gain: {b['iteration_cost_s'] * 1000:g} ms per iteration + {b['sequence_cost_s'] * 1000:g} ms "
            f"per sequence ({b['clock']} clock), {b['num_requests']} long-tailed requests, batch {b['batch_size']}:\n\n"
            + _table(["policy", "output tok/s", "slot occupancy while work waits", "iterations"], modes))
    return out


@_bench("broker.json", "Broker")
def bench_broker(d: dict) -> str:
    def cpu(r: dict) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in r.get("cpu_us_per_request", {}).items())
    out = _table(["workers", "slots", "requests", "requests/s", "CPU us per request"],
                 [[r["workers"], r["slots"], r["requests"], r["requests_per_s"], cpu(r)] for r in d["throughput"]])
    lat = d["latency"]
    occ = d["occupancy"]
    out += (f"\n\nAdded latency over the in-process engine ({lat['requests']:,} requests one at a time): "
            f"p50 +{lat['added_p50_ms']:.2f} ms, p99 +{lat['added_p99_ms']:.2f} ms. Slot occupancy with a "
            f"{occ['step_delay_ms']:g} ms step, {occ['workers']} workers x {occ['slots']} slots: {occ['occupancy']:.3f}.\n\n"
            + _table(["workers", "output tok/s", "speed-up"],
                     [[r["workers"], r["output_tokens_per_s"], r["speedup"]] for r in d["scaling"]])
            + f"\n\nLoad {_run_load(d)}.")
    return out


@_bench("broker_routing.json", "Broker")
def bench_broker_routing(d: dict) -> str:
    r = d["routing"]
    rows = [[f"`{p}`", v["on_req_per_s"], v["off_req_per_s"], v["on_over_off"], v["broker_cpu_us_per_request_on"],
             v["broker_cpu_us_per_request_off"]] for p, v in r["by_prompt"].items()]
    return (_table(["prompts", "prefix-aware req/s", "credit-only req/s", "ratio", "broker CPU us/req (aware)",
                    "broker CPU us/req (credit-only)"], rows)
            + f"\n\n{r['workers']} workers, {r['requests']:,} requests per run, {r['rounds']} rounds alternated; "
              f"load {_run_load(d)}.")


def _serve_sweep(d: dict) -> str:
    rows = [[r["via"], "burst" if r["rate"] is None else r["rate"], r["requests"], r["output_tokens_per_s"],
             r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"], r["itl_p50_ms"], r["e2e_p50_ms"],
             _row_load(r)] for r in d["sweep"]]
    c = d["config"]
    return (_table(["via", "rate req/s", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                    "ITL p50 ms", "E2E p50 ms", "load"], rows)
            + f"\n\nModel `{c['model']}`, {c['slots']} slots, `max_tokens` {c['max_tokens']}"
              + (f", {c['step_delay_ms']:g} ms per step" if c.get("step_delay_ms") else "")
              + f"; load {_run_load(d)} over the run.")


@_bench("serve.json", "HTTP gateway")
def bench_serve(d: dict) -> str:
    out = _serve_sweep(d)
    a, t = d["added_latency"], d["throughput"]
    cpu = ", ".join(f"{k} {v:.0f}" for k, v in t["cpu_us_per_request"].items())
    return (out + f"\n\nAdded by HTTP over the Python client: p50 +{a['added_p50_ms']:.2f} ms "
                  f"({a['requests']:,} requests one at a time). Short non-streamed requests at concurrency "
                  f"{t['concurrency']}: {t['requests_per_s']:,.0f} requests/s, {t['errors']} errors; CPU us per "
                  f"request: {cpu}.")


@_bench("serve_smollm2-135m.json", "HTTP gateway")
def bench_serve_model(d: dict) -> str:
    return _serve_sweep(d)


@_bench("lmeval.json", "lm-eval")
def bench_lmeval(d: dict) -> str:
    mc, gen = d["mc"], d["gen"]
    rows = [["`slotserve_facts_mc` acc (`local-completions`)", mc["acc"]["slotserve"], mc["acc"]["hf"],
             f"{mc['requests']} loglikelihoods, max abs difference {mc['max_abs_diff']:.2g}; "
             f"{mc['questions'] - len(mc['differing_predictions'])}/{mc['questions']} questions the same choice"],
            ["`slotserve_facts_mc` acc_norm", mc["acc_norm"]["slotserve"], mc["acc_norm"]["hf"], ""],
            ["`slotserve_facts_gen` acc (`local-chat-completions`)", gen["acc"]["slotserve"], gen["acc"]["hf"],
             f"{gen['questions'] - len(gen['differing_replies'])}/{gen['questions']} replies identical"]]
    walls = ", ".join(f"{k} {v:g} s" for k, v in d["wall_s"].items())
    c = d["config"]
    return (_table(["task (lm-eval model)", "slotserve", "lm-eval `hf`", "per request"], rows)
            + f"\n\nlm-eval {c['lm_eval']}, `{c['model']}`, {c['slots']} slots; wall time: {walls}; "
              f"load {_run_load(d)}.")


@_bench("text.json", "Smaller costs")
def bench_text(d: dict) -> str:
    rows = [[c["case"], c["us_per_token"], c["overhead_us_per_token"], c["overhead_pct_of_smollm2_token"]]
            for c in d["cases"]]
    return (_table(["case", "us per token", "overhead us per token", "% of a SmolLM2 token"], rows)
            + f"\n\nBatch {d['batch']}, {d['requests']} requests x {d['max_tokens']} tokens, tokenizer "
              f"`{d['tokenizer']}`, a SmolLM2 decode step of {d['smollm2_decode_step_ms']:g} ms; "
              f"load {_run_load(d)}.")


@_bench("structured.json", "Smaller costs")
def bench_structured(d: dict) -> str:
    c, s = d["compile"], d["speed"]["median"]
    validity = [[f"{float(t):g}", v["cases"], v["stop"], v["stop_valid"], v["length"]]
                for t, v in d["validity"].items()]
    return (f"Compiling a constraint: {c['new_ms_median']:.2f} ms new (median), {c['cached_ms_median'] * 1000:.1f} us "
            f"cached. Decoding {d['speed']['requests']} requests on {d['speed']['slots']} slots: free "
            f"{s['free']:.1f} tok/s, constrained {s['constrained']:.1f} tok/s; the masks took "
            f"{s['mask_ms_per_row']:.3f} ms per row ({s['mask_share'] * 100:.1f} % of the time). "
            f"Load {_run_load(d)}.\n\n"
            + _table(["temperature", "cases", "ended stop", "stop and valid", "ended length"], validity))


@_bench("load.json", "Smaller costs")
def bench_load(d: dict) -> str:
    rows = [[r["path"], r["seconds"], _row_load(r)] for r in d["runs"]]
    return f"Loading `{d['model']}`:\n\n" + _table(["path", "seconds", "load"], rows)


@_bench("logprobs.json", "Smaller costs")
def bench_logprobs(d: dict) -> str:
    steps = d["decode_step_ms"]
    p = d["prefill"]
    return (f"`{d['model']}` {d['precision']}, {d['slots']} slots, {d['threads']} threads: a decode step "
            f"{steps.get('None')} ms without logprobs, {steps.get('5')} ms with `logprobs: 5`; a "
            f"{p['prompt_tokens']}-token prefill {p['plain']:g} ms, {p['prompt_logprobs']:g} ms with "
            f"`prompt_logprobs` ({p['ratio']:.2f}x). Load {_run_load(d)}.")


@_bench("gateway_tokenizer.json", "Smaller costs")
def bench_gateway_tokenizer(d: dict) -> str:
    rows = [[i + 1, u["banner_s"], u["health_s"], u["tokenize_s"], u["first_echo_logprobs_s"]]
            for i, u in enumerate(d["up"])]
    return ("`slotserve up --http-port` with SmolLM2, seconds from start:\n\n"
            + _table(["run", "banner", "`/health` 200", "`/tokenize` answers", "first echo + logprobs"], rows)
            + f"\n\nLoad {_run_load(d)}.")


@_bench("chaos.json", "Reliability runs")
def bench_chaos(d: dict) -> str:
    r, c = d["runs"][-1], d["config"]
    return _table(["requests", "ended once", "mismatches", "duplicate callbacks", "missing", "worker kills",
                   "broker kills", "migrations", "wall s"],
                  [[r["requests"], r["completed_once"], r["mismatches"], r["duplicate_callbacks"], r["missing"],
                    r["worker_kills"], r["broker_kills"], r["migrations"], r["wall_s"]]]) + (
        f"\n\n{c['workers']} workers x {c['slots']} slots, a worker killed every {c['kill_interval_s']:g} s.")


@_bench("fuzz.json", "Reliability runs")
def bench_fuzz(d: dict) -> str:
    return _table(["frames (frontend / backend)", "bad messages", "hangs", "crashes", "internal errors",
                   "valid traffic after"],
                  [[f"{d['frames_frontend']:,} / {d['frames_backend']:,}", d["bad_messages"], d["hangs"], d["crashes"],
                    d["internal_errors"], d["valid_traffic_after"]]])


@_bench("soak.json", "Reliability runs")
def bench_soak(d: dict) -> str:
    s = d["summary"]
    return _table(["requests", "errors", "requests/s", "broker RSS MiB after warm-up (min-max)", "final RSS MiB",
                   "growth after warm-up"],
                  [[s["requests"], s["errors"], s["req_per_s"],
                    f"{s['rss_after_warmup_min_mib']:.1f}-{s['rss_after_warmup_max_mib']:.1f}", s["rss_final_mib"],
                    f"{s['growth_after_warmup'] * 100:.1f} %"]])


# Results files shown only in the index (no table of their own): why.
_INDEX_ONLY = {
    "model_all_systems_loaded.json": "`python -m bench.model` with every system, on a loaded machine (raw)",
    "model_qwen2.5-coder-0.5b_smoke.json": "smoke run of the Qwen table (2 prompts, 8 tokens, load ~4-7): plumbing only",
    "model_qwen2.5-coder-1.5b_smoke.json": "smoke run of the Qwen table (2 prompts, 8 tokens, load ~9): plumbing only",
    "model_qwen2.5-coder-0.5b_avx2.json": "HE32 on a 2-core AMD EPYC Zen 3 (AVX2 only): the AVX2 product ([models](models.md#on-avx2))",
    "model_qwen2.5-coder-1.5b_avx2.json": "HE32 on the AVX2-only EPYC, no HF reference ([models](models.md#on-avx2))",
    "model_qwen2.5-coder-1.5b_avx2_reference.json": "HE32 on the AVX2-only EPYC with the HF fp32 greedy reference: "
                                                    "agreement 26/32 against llama.cpp's 21 (other work running, load "
                                                    "6.3-10.2: its times are not comparable) ([models](models.md#on-avx2))",
    "model_smollm2_gguf_avx2.json": "HE32 on the AVX2-only EPYC ([models](models.md#on-avx2))",
    "step_profile_gguf_qwen2.5-coder-1.5b_avx2.json": "decode steps on the AVX2-only EPYC ([models](models.md#on-avx2))",
    "threads_avx2.json": "quiet and busy throughput on the AVX2-only EPYC ([models](models.md#on-avx2))",
}


def bench_files(root: Path) -> str:
    """Every results file, its script, and whether a table above shows it."""
    rows = []
    for path in sorted((root / "bench" / "results").glob("*.json")):
        parts = path.stem.split("_")  # model_gemma3-270m.json: bench/model.py; gateway_tokenizer.json: its own
        script = next(("_".join(parts[:n]) for n in range(len(parts), 0, -1)
                       if (root / "bench" / f"{'_'.join(parts[:n])}.py").exists()), parts[0])
        shown = _BENCH_FILES.get(path.name)
        rows.append([f"`{path.name}`", f"`python -m bench.{script}`",
                     f"under \"{shown}\"" if shown else _INDEX_ONLY.get(path.name, "raw only (no table yet)")])
    return _table(["results file", "written by", "shown"], rows)


GENERATORS.update(request_parameters=request_parameters, metrics=metrics, bench_files=bench_files)
