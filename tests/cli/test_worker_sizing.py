"""Sensible names and sizes for a local cluster (issue 31 item 7).

- A ``.gguf`` model is served under its file's stem, its path still accepted
  as an alias (:func:`worker.config.default_served_names`); `up` and `run`
  ask for and print the short name; the gateway finds the tokenizer through
  the alias.
- `up` and `run` start as many workers as the machine fits
  (:func:`slotserve.sizing.plan_workers`, pure: tested on made-up machines),
  split the cores between them, and print the decision; ``--workers``
  overrides the count.
"""

from __future__ import annotations

import asyncio
import struct

import pytest
from click.testing import CliRunner

from slotserve.cli import main
from slotserve.sizing import (BASE_BYTES, LOAD_FACTOR, Machine, ModelSize, MAX_WORKERS, estimate_model,
                              plan_workers)
from tests.support.launcher import record_clusters
from worker.config import WorkerConfig, default_served_names

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("model,names", [
    ("/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", ("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
                                                         "/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf")),
    ("tiny.GGUF", ("tiny", "tiny.GGUF")),
    ("smollm2-135m", ("smollm2-135m",)),
    ("simulated", ("simulated",)),
    ("/models/Qwen2.5-0.5B-Instruct", ("/models/Qwen2.5-0.5B-Instruct",)),  # no such folder here: as given
    ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct",)),  # a hub id
    (".gguf", (".gguf",)),
])
def test_a_gguf_file_is_served_under_its_stem_and_its_path(model, names):
    assert default_served_names(model) == names
    assert WorkerConfig(model=model).served_names == names
    assert WorkerConfig(model=model, served_model_names=("mine",)).served_names == ("mine",)


@pytest.mark.parametrize("spelt", ["{dir}", "{dir}/", "./{rel}"])
def test_a_model_folder_is_served_under_its_name_and_its_path(tmp_path, monkeypatch, spelt):
    """A folder that exists is served by its name first, the path as given an alias (as a file's stem
    is, and as `up` with several models and --models-dir name folders); it was served by its whole path
    alone with one model, by its name with several."""
    folder = tmp_path / "Qwen2.5-0.5B-Instruct"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    model = spelt.format(dir=folder, rel=folder.name)
    assert default_served_names(model) == ("Qwen2.5-0.5B-Instruct", model)
    assert WorkerConfig(model=model).served_names == ("Qwen2.5-0.5B-Instruct", model)
    monkeypatch.chdir(folder)
    assert default_served_names(".") == (folder.name, ".")  # (the name of the folder "." is)


def _size(steady_mib: float, peak_mib: float) -> ModelSize:
    return ModelSize(1, int(steady_mib * MiB), int(peak_mib * MiB))


def test_on_two_cores_two_workers_of_one_thread_as_memory_allows():
    plan = plan_workers(Machine(2, 20 * GiB), _size(2300, 5300))
    assert (plan.workers, plan.threads) == (2, 1)
    assert plan.reason.startswith("starting 2 workers (2 cores), 1 thread each")
    assert "model ~2,300 MiB per worker (~5,300 MiB while loading), 20.0 GiB available" in plan.reason
    plan = plan_workers(Machine(2, 8 * GiB), _size(2300, 5300))  # 0.8 x 8 GiB holds one load peak
    assert (plan.workers, plan.threads) == (1, None)
    assert plan.reason.startswith("starting 1 worker (2 cores, memory for 1), 2 threads")


def test_more_cores_more_workers_as_memory_allows():
    plan = plan_workers(Machine(4, 64 * GiB), _size(1000, 2000))
    assert (plan.workers, plan.threads) == (4, 1)
    plan = plan_workers(Machine(32, 64 * GiB), _size(1000, 2000))
    assert (plan.workers, plan.threads) == (MAX_WORKERS, 32 // MAX_WORKERS)
    plan = plan_workers(Machine(32, 5 * GiB), _size(1000, 2000))  # 0.8 x 5 GiB holds two load peaks
    assert (plan.workers, plan.threads) == (2, 16) and "memory for 2" in plan.reason
    plan = plan_workers(Machine(32, 64 * GiB), _size(1000, 2000), threads=2)  # --threads 2: 16 workers
    assert (plan.workers, plan.threads) == (16, 2)
    plan = plan_workers(Machine(32, 64 * GiB), None)  # size unknown: cores decide
    assert plan.workers == MAX_WORKERS and "MiB" not in plan.reason


def test_a_model_too_big_still_gets_one_worker_with_a_warning():
    plan = plan_workers(Machine(4, 1 * GiB), _size(3000, 6000))
    assert plan.workers == 1 and "may not fit" in plan.reason


def test_workers_given_override_the_count_and_split_the_cores():
    plan = plan_workers(Machine(2, 1 * GiB), _size(3000, 6000), workers=2)
    assert (plan.workers, plan.threads) == (2, 1) and "(--workers)" in plan.reason and "may not fit" in plan.reason
    assert plan_workers(Machine(8, 64 * GiB), None, workers=3, threads=4).threads == 4


def test_cuda_and_the_simulated_model():
    assert plan_workers(Machine(16, 64 * GiB), _size(1, 1), device="cuda").workers == 1
    assert plan_workers(Machine(16, 64 * GiB, gpu=True), _size(1, 1), device="auto").workers == 1
    assert plan_workers(Machine(16, 64 * GiB, gpu=False), _size(1, 1), device="auto").workers == MAX_WORKERS
    plan = plan_workers(Machine(2, 1 * GiB), None, simulated=True)
    assert (plan.workers, plan.threads, plan.reason) == (2, None, "starting 2 simulated workers")
    assert plan_workers(Machine(2, 1 * GiB), None, simulated=True, workers=5).workers == 5


def test_the_estimate_of_a_gguf_file_counts_its_tensors(tmp_path):
    pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    params = 64 * 32 + 32
    fp32 = estimate_model(path, "fp32")
    assert fp32 == ModelSize(params, BASE_BYTES + 4 * params, int(BASE_BYTES + 4 * params + LOAD_FACTOR * 4 * params))
    assert estimate_model(path, "auto") == fp32
    assert estimate_model(path, "bf16").steady_bytes == BASE_BYTES + 2 * params
    garbage = tmp_path / "bad.gguf"
    garbage.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 8)
    assert estimate_model(str(garbage)) is None
    assert estimate_model("simulated") is None and estimate_model("no/such-hub-model") is None


def test_the_estimate_of_a_folder_reads_its_weight_files(tmp_path):
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2000)
    assert estimate_model(str(tmp_path), "fp32").params == 1000


def test_up_serves_a_gguf_under_its_stem_and_prints_the_plan(monkeypatch, tmp_path):
    clusters = record_clusters(monkeypatch)
    path = str(tmp_path / "Tiny-Q8_0.gguf")
    with open(path, "wb") as f:
        f.write(b"GGUF")  # GGUF's magic and no header: a GGUF by its name check, its size unknown, cores decide
    r = CliRunner().invoke(main, ["up", "--model", path, "--no-warmup"])
    assert r.exit_code == 0, r.output
    cfg = clusters[-1]
    assert cfg.workers[0].served_names == ("Tiny-Q8_0", path)
    assert "slotserve: starting " in r.output and "served as 'Tiny-Q8_0'" in r.output
    n = len(cfg.workers)
    assert n == min(MAX_WORKERS, Machine.here().cores)
    assert cfg.workers[0].model_options.num_threads == (None if n == 1 else Machine.here().cores // n)
    r = CliRunner().invoke(main, ["up", "--model", path, "--workers", "3", "--threads", "1", "--no-warmup"])
    assert r.exit_code == 0, r.output
    assert len(clusters[-1].workers) == 3 and clusters[-1].workers[0].model_options.num_threads == 1
    assert "starting 3 workers (--workers), 1 thread each" in r.output
    # two models on demand: none starts now, so no plan of started workers is printed
    r = CliRunner().invoke(main, ["up", "--model", path, "--model", "simulated", "--no-warmup"])
    assert r.exit_code == 0, r.output
    assert clusters[-1].workers == () and len(clusters[-1].on_demand) == 2
    assert "slotserve: starting" not in r.output and "models on demand" in r.output


def test_the_gateway_loads_a_tokenizer_through_the_alias():
    from gateway.tokenizer import Tokenizers

    asked = []

    def load(name):
        asked.append(name)
        return "tok" if name.endswith(".gguf") else None

    tokenizers = Tokenizers(load, names_of=lambda model: (model, f"/m/{model}.gguf"))
    assert asyncio.run(tokenizers.get("Tiny")) == "tok" and asked == ["Tiny", "/m/Tiny.gguf"]
    assert asyncio.run(Tokenizers(load, "/one.gguf", names_of=lambda m: 1 / 0).get("Tiny")) == "tok"


def test_a_tokenizer_not_found_by_the_names_known_then_is_looked_up_again_by_new_names():
    """A model on demand asked for before its worker said its aliases (a --models-dir name, whose
    .gguf path only the worker tells): the lookup by its name alone finds none, and it is tried
    again once the path is known, not cached as "no tokenizer" for good."""
    from gateway.tokenizer import Tokenizers

    known = {"Tiny": ("Tiny",)}

    def load(name):
        return "tok" if name.endswith(".gguf") else None

    async def scenario():
        tokenizers = Tokenizers(load, names_of=lambda model: known[model])
        first = await tokenizers.get("Tiny")
        known["Tiny"] = ("Tiny", "/m/Tiny.gguf")  # its worker registered it under its path too
        return first, await tokenizers.get("Tiny"), await tokenizers.get("Tiny")

    assert asyncio.run(scenario()) == (None, "tok", "tok")


def test_a_block_quantised_gguf_is_estimated_as_stored_at_auto_and_gguf(tmp_path):
    """auto serves such a file at precision gguf on CPU: its weights as codes and scales
    (worker.models.gguf_blocks.held_bytes), not fp32 -- no more than the runner holds, and the
    load's peak no longer a multiple of the fp32 weights."""
    pytest.importorskip("gguf")
    from tests.support.tiny_gguf import write_quantized_gguf
    from worker.models import load_model

    path = str(tmp_path / "q.gguf")
    write_quantized_gguf(path, "qwen2")
    auto, stored, fp32 = (estimate_model(path, p) for p in ("auto", "gguf", "fp32"))
    assert auto == stored and stored.params == fp32.params
    assert stored.steady_bytes < fp32.steady_bytes and stored.peak_bytes < fp32.peak_bytes
    held = load_model(path, precision="gguf").weights.nbytes
    assert held <= stored.steady_bytes - BASE_BYTES <= 1.5 * held
