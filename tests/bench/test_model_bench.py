"""bench/model.py's --model and bench/gpu.py's shapes (issue 24): what the HE32 and random-weight
runs are built from, checked without running them (the runs themselves are benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("psutil")

pytestmark = pytest.mark.hf

from bench import gpu  # noqa: E402
from bench import model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_results_file_per_model():
    assert model.results_stem("smollm2-135m") == "model"  # the SmolLM2 results keep their name
    assert model.results_stem("gemma3-270m") == "model_gemma3-270m"
    assert model.results_stem("/x/y/gemma-3-270m-q4_k_m.gguf") == "model_gemma-3-270m-q4_k_m"
    assert model.results_stem("/tmp/my model/") == "model_my_model"


class _Tok:
    unk_token_id = 3
    vocab = {"<eos>": 1, "<end_of_turn>": 106}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, self.unk_token_id)


class _Codec:
    _tok = _Tok()


def test_gemma_stops_at_end_of_turn_besides_eos(monkeypatch):
    assert model.stop_ids("gemma3_text", (1,), _Codec()) == {1, 106}
    assert model.stop_ids("gemma2", [1], _Codec()) == {1, 106}
    assert model.stop_ids("llama", (2, 0), _Codec()) == {0, 2}  # no extra stops
    monkeypatch.setitem(model.EXTRA_STOPS, "gemma3_text", ("<end_of_turn>", "<nope>"))
    with pytest.raises(ValueError, match="<nope>"):
        model.stop_ids("gemma3_text", (1,), _Codec())


def test_qwen_stops_at_endoftext_besides_im_end(monkeypatch):
    monkeypatch.setattr(_Tok, "vocab", {"<|im_end|>": 151645, "<|endoftext|>": 151643})
    assert model.stop_ids("qwen2", (151645,), _Codec()) == {151643, 151645}


def test_precisions_are_what_the_worker_takes():
    """--precisions entries are checked by the worker's own ModelOptions (so a precision the worker
    gains is benchmarked with no change here); a bad one is a usage error naming it."""
    ap = model.parser()
    args = ap.parse_args(["--precisions", "hf,fp32,bf16+spec3,int8"])
    model.skipped_systems(ap, args)  # no error
    for bad in ("fp8", "fp32+specx"):
        with pytest.raises(SystemExit) as exit_:
            model.skipped_systems(ap, ap.parse_args(["--precisions", f"fp32,{bad}"]))
        assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        model.skipped_systems(ap, ap.parse_args(["--max-tokens", "0"]))


def test_the_served_table_has_each_precision_and_llamacpp():
    from bench.systems import Run

    ref = [[1, 2, 3], [4, 5]]
    runs = [Run("hf-alone", wall_s=2.0, outputs=ref, first_s=[0.1, 0.2], last_s=[1.0, 2.0]),
            Run("slotserve-broker[fp32]", wall_s=1.0, outputs=ref, first_s=[0.1, 0.1], last_s=[0.5, 1.0],
                rss_mb=900.4, threads=2, ready_s=12.34),
            Run("slotserve-broker[bf16]", wall_s=0.5, outputs=[[1, 2, 9], [4, 5]], first_s=[0.1, 0.1],
                last_s=[0.2, 0.5], rss_mb=500.0, threads=1, ready_s=10.0),
            Run("llamacpp", wall_s=0.25, outputs=ref, first_s=[0.1, 0.1], last_s=[0.2, 0.25], rss_mb=300.0,
                threads=2, ready_s=1.5)]
    rows = [r.summary(ref) for r in runs]
    table = model.served_table(rows, 2, "hf-alone")
    assert [(r["system"], r["threads"], r["tokens_per_s"], r["worker_rss_mib"], r["identical_to_reference"],
             r["start_to_ready_s"]) for r in table] == [
        ("slotserve-broker[fp32]", 2, 5.0, 900, 2, 12.3), ("slotserve-broker[bf16]", 1, 10.0, 500, 1, 10.0),
        ("llamacpp", 2, 20.0, 300, 2, 1.5)]
    assert {r["requests"] for r in table} == {2} and {r["reference"] for r in table} == {"hf-alone"}


def test_the_served_table_gives_the_weights_a_step_reads(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))  # tied: the head
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((1024, 512), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(model.llamacpp, "gguf_path", lambda _m: path)
    params = 1024 * 512 + 16 * 32
    assert model.step_weights_mib("m", "slotserve-broker[fp32+spec2]") == round(4 * params / 2**20, 1)
    assert model.step_weights_mib("m", "slotserve-broker[hf]") == round(4 * params / 2**20, 1)
    assert model.step_weights_mib("m", "slotserve-broker[bf16]") == round(2 * params / 2**20, 1)
    assert model.step_weights_mib("m", "llamacpp") == round((2 * 1024 * 512 + 4 * 16 * 32) / 2**20, 1)
    assert model.step_weights_mib("m", "slotserve-broker[fp8]") is None  # a precision of unknown size
    monkeypatch.setattr(model.llamacpp, "gguf_path", lambda _m: (_ for _ in ()).throw(ValueError("not a GGUF")))
    assert model.step_weights_mib("m", "llamacpp") is None


def test_shapes_are_their_families_configs():
    qwen = gpu.shape_config("qwen2.5-0.5b", tiny=False)
    assert type(qwen).__name__ == "Qwen2Config"
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.intermediate_size, qwen.vocab_size, qwen.tie_word_embeddings) == (896, 24, 14, 2, 4864, 151936, True)
    gemma = gpu.shape_config("gemma-2-2b", tiny=False)
    assert type(gemma).__name__ == "Gemma2Config"
    assert (gemma.hidden_size, gemma.num_hidden_layers, gemma.head_dim, gemma.num_key_value_heads,
            gemma.vocab_size, gemma.final_logit_softcapping, gemma.attn_logit_softcapping,
            gemma.query_pre_attn_scalar) == (2304, 26, 256, 4, 256000, 30.0, 50.0, 256)
    tiny = gpu.shape_config("gemma-2-2b", tiny=True)
    assert (tiny.hidden_size, tiny.head_dim, tiny.vocab_size) == (64, 16, 1024)
    assert type(gpu.shape_config("smollm2-135m", tiny=False)).__name__ == "LlamaConfig"


def test_cases_per_device_and_shape():
    new = {"qwen2.5-0.5b", "gemma-2-2b"}
    cpu = gpu.cases_for("cpu", sorted(new))
    cuda = gpu.cases_for("cuda", sorted(new))
    assert {c.workload for c in cpu} == {"he8"} and {c.shape for c in cpu} == new  # a 2B on 2 cores: 8 prompts
    assert {c.workload for c in cuda} == {"mix256"} and {c.shape for c in cuda} == new
    assert {c.slots for c in cuda} == {64}
    assert set(gpu.cases_for("cpu", tiny=True)) == set(gpu.CASES)  # --tiny checks the plumbing of every case
    assert {c.shape for c in gpu.cases_for("cuda")} == set(gpu.SHAPES)
    with pytest.raises(ValueError, match="gemma-9"):
        gpu.cases_for("cpu", ["gemma-9"])


def test_shapes_and_tiny_need_random_weights():
    done = subprocess.run([sys.executable, "-m", "bench.model", "--shapes", "gemma-2-2b"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                              "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert "--random-weights only" in done.stderr


def test_the_greedy_reference_is_kept_and_read_back_for_the_same_key_only(tmp_path, monkeypatch):
    """hf-alone (a 1.5B model's reference takes ~14 min on 2 cores) runs once per key: a second run of
    the same model, workload and thread count reads its outputs back; another thread count, another
    workload, a changed model file or --fresh-reference runs it again."""
    calls = []

    def fake_run(hf, prompts, max_tokens, eos, pad_id):
        calls.append(len(calls))
        run = model.Run("hf-alone")
        run.outputs = [[len(calls), 5, 6][:m] for m in max_tokens]
        run.first_s, run.last_s, run.wall_s = [0.5] * len(prompts), [1.0] * len(prompts), 2.0
        return run

    monkeypatch.setattr(model, "run_hf_alone", fake_run)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    he = model.Workload(SimpleNamespace(model="the transformers module"), [[1, 2, 3], [4]], [3, 2], {2}, 2, str(gguf))
    cache = tmp_path / "cache"

    first = model.cached_hf_alone(he, 2, cache=cache)
    again = model.cached_hf_alone(he, 2, cache=cache)
    assert calls == [0] and again.outputs == first.outputs == [[1, 5, 6], [1, 5]]
    assert (again.first_s, again.last_s, again.wall_s) == (first.first_s, first.last_s, first.wall_s)
    assert "read from" in again.note and "read from" not in first.note

    model.cached_hf_alone(he, 1, cache=cache)  # another thread count
    assert len(calls) == 2
    he.max_tokens = [3, 1]  # another workload
    model.cached_hf_alone(he, 2, cache=cache)
    assert len(calls) == 3
    gguf.write_bytes(b"GGUF two, longer")  # the model file changed
    model.cached_hf_alone(he, 2, cache=cache)
    assert len(calls) == 4
    assert model.cached_hf_alone(he, 2, cache=cache).outputs == [[4, 5, 6], [4]]  # kept: no run
    assert len(calls) == 4
    model.cached_hf_alone(he, 2, fresh=True, cache=cache)
    assert len(calls) == 5
    assert not list(cache.glob("*.tmp"))


def test_interleave_runs_the_worker_systems_and_llamacpp_in_rounds(monkeypatch):
    """``--interleave --repeats 3``: round 1 runs every chosen system, rounds 2 and 3 only the
    worker and llama.cpp (hf-alone read back for llama.cpp's lengths); each keeps its fastest run
    and lists every round's wall time; llama.cpp's details are its fastest round's."""
    from bench.systems import Run

    order, walls = [], {"slotserve-broker[gguf]": iter([3.0, 2.0, 2.5]), "llamacpp": iter([9.0, 8.0, 8.5]),
                        "slotserve": iter([5.0]), "hf-alone": iter([7.0, 7.0, 7.0])}

    def fake_systems(he, precisions, slots, start_timeout_s=900.0, fresh_reference=False):
        def runner(name):
            def run_once(threads):
                order.append(name)
                return Run(name, wall_s=next(walls[name]), outputs=[[1]])
            return run_once
        return {n: runner(n) for n in ("slotserve", "slotserve-broker[gguf]", "hf-alone")}

    def fake_llamacpp_last(runs, he, args, extra, kept=None):
        assert any(r.name == "hf-alone" for r in runs)  # its lengths come from the reference
        order.append("llamacpp")
        wall = next(walls["llamacpp"])
        runs.append(Run("llamacpp", wall_s=wall, outputs=[[1]], all_wall_s=[wall]))
        extra["llamacpp"] = {"wall": wall}

    monkeypatch.setattr(model, "systems", fake_systems)
    monkeypatch.setattr(model, "llamacpp_last", fake_llamacpp_last)
    he = SimpleNamespace(model=object(), prompts=[[1]], max_tokens=[1], eos={0}, pad_id=0, name="m")
    args = SimpleNamespace(repeats=3, slots=8, start_timeout_s=1.0, fresh_reference=True, no_limits=True,
                           interleave=True, llamacpp_threads="2")
    runs, extra = model.interleaved(he, ["gguf"], args, [2], set())
    assert order == ["slotserve", "hf-alone", "slotserve-broker[gguf]", "llamacpp",
                     "hf-alone", "slotserve-broker[gguf]", "llamacpp",
                     "hf-alone", "slotserve-broker[gguf]", "llamacpp"]
    by_name = {r.name: r for r in runs}
    assert by_name["slotserve-broker[gguf]"].wall_s == 2.0
    assert by_name["slotserve-broker[gguf]"].all_wall_s == [3.0, 2.0, 2.5]
    assert by_name["llamacpp"].wall_s == 8.0 and by_name["llamacpp"].all_wall_s == [9.0, 8.0, 8.5]
    assert by_name["slotserve"].all_wall_s == [5.0] and by_name["hf-alone"].all_wall_s == [7.0]
    assert extra == {"llamacpp": {"wall": 8.0}}


@pytest.mark.parametrize("entry", ["hf", "fp32", "gguf", "gguf-int8", "gguf+spec3", "bf16+kvbf16"])
def test_the_worker_systems_run_without_the_prefix_cache(entry):
    """The warm-up sends the first prompts; llama.cpp runs with ``cache_prompt`` off, so the worker
    must not take those prompts' prefill from its prefix cache either (the 0.5B's HE32: 736 of
    2,955 prompt tokens, 9 % of its wall time, before this was off)."""
    assert model.model_options(entry, 2).prefix_cache_mb == 0


def test_the_in_process_engine_runs_without_the_prefix_cache(tmp_path):
    """:func:`bench.systems.slotserve` warms up on the prompts it then measures: with the runner's
    default prefix cache on, their prefill would come from the cache; it runs with the cache off."""
    import random

    from bench import systems
    from tests.support.slot_models import TINY_LLAMA_VOCAB, save_tiny_llama
    from worker.models import load_model

    save_tiny_llama(tmp_path)
    runner = load_model(str(tmp_path))
    assert runner.prefix_cache_mb is None  # the default: sized from the machine, on
    rng = random.Random(0)
    prompts = [[rng.randrange(1, TINY_LLAMA_VOCAB) for _ in range(40)] for _ in range(3)]
    run = systems.slotserve(runner, prompts, [3, 3, 3], slots=2)
    assert runner.prefix_cache is None and runner.prefix_cache_mb == 0
    assert [len(out) for out in run.outputs] == [3, 3, 3]
