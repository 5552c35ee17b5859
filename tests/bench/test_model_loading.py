"""bench/model.py loads the HF model (54-74 s for Qwen2.5-Coder-0.5B) only when something of the run
needs it: the in-process systems, the forward-pass limits, hf-alone where its outputs are not kept.
Before, ``load_he`` loaded it for every run, for its tokenizer and stop ids, so that a run of
``--systems slotserve-broker,llamacpp --no-limits`` spent a minute loading a model nothing ran.

The workload made without the weights (:func:`bench.model.model_facts`) is the loaded model's; a run
without hf-alone takes the kept reference for its agreement column, or leaves the column blank and
says why, never loading the model for it."""

from __future__ import annotations

import shutil
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("psutil")

pytestmark = pytest.mark.hf

from bench import model  # noqa: E402
from bench.systems import Run  # noqa: E402


class _Codec:
    """A text codec whose tokenizer knows no extra stop (model_type llama has none)."""

    _tok = None

    def encode(self, text):
        return [ord(c) for c in text]


FACTS = model.ModelFacts(_Codec(), "llama", (2,), None)


def _no_load(*args, **kwargs):
    raise AssertionError("the HF model was loaded")


@pytest.fixture
def light(monkeypatch, tmp_path):
    """bench.model with the model never loaded (load_model raises), facts and prompts faked, the kept
    references under ``tmp_path``."""
    monkeypatch.setattr(model, "load_model", _no_load)
    monkeypatch.setattr(model, "model_facts", lambda name: FACTS)
    monkeypatch.setattr(model, "he32", lambda codec, n: ([[5, 6, 7], [8, 9]][:n], [3, 2][:n]))
    monkeypatch.setattr(model, "REFERENCE_CACHE", tmp_path / "kept")
    return model


def _kept(he, threads: int, outputs, wall_s: float) -> None:
    """hf-alone's run of ``he`` at ``threads`` kept, as cached_hf_alone keeps it."""
    path = model.kept_path(he, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.json.dumps({"outputs": outputs, "first_s": [0.1] * len(outputs),
                                      "last_s": [0.2] * len(outputs), "wall_s": wall_s, "when": "then"}))


def test_what_needs_the_model():
    assert model.model_needs({"slotserve-broker", "llamacpp", "hf-alone"}, limits=False) == []
    assert model.model_needs({"hf-static", "slotserve-broker"}, limits=False) == ["hf-static (runs on it)"]
    assert model.model_needs({"slotserve", "hf-cb"}, limits=True) == [
        "slotserve (runs on it)", "hf-cb (runs on it)", "the forward-pass limits (--no-limits skips them)"]


def test_the_workload_is_made_without_the_model_where_nothing_needs_it(light):
    he = light.load_he(2, 2, "m", max_tokens_cap=2)
    assert he.model is None and he.facts is FACTS
    assert (he.prompts, he.max_tokens, he.eos, he.pad_id) == ([[5, 6, 7], [8, 9]], [2, 2], {2}, 2)


def test_hf_alone_kept_is_read_back_without_the_model_and_run_where_it_is_not(light, monkeypatch):
    he = light.load_he(2, 2, "m")
    _kept(he, 2, [[1, 2, 3], [4, 5]], 3.0)
    assert light.cached_hf_alone(he, 2).outputs == [[1, 2, 3], [4, 5]]  # (load_model raises)
    loads = []

    class Runner:
        model = "the transformers module"
        tokenizer = FACTS.codec
        eos_token_ids = (2,)

    def load(name, **options):
        loads.append((name, options))
        return Runner()

    monkeypatch.setattr(model, "load_model", load)
    monkeypatch.setattr(model, "runner_facts", lambda runner: FACTS)
    monkeypatch.setattr(model, "run_hf_alone", lambda hf, *a: Run("hf-alone", wall_s=1.0, outputs=[[9], [9]]))
    assert light.cached_hf_alone(he, 1).outputs == [[9], [9]]  # another thread count: not kept, so run
    assert loads == [("m", {"num_threads": 2, "runner": "hf"})]


def test_a_loaded_model_that_is_not_the_workloads_is_refused(light, monkeypatch):
    he = light.load_he(2, 2, "m")

    class Runner:
        model = None

    monkeypatch.setattr(model, "load_model", lambda name, **options: Runner())
    monkeypatch.setattr(model, "runner_facts", lambda runner: model.ModelFacts(FACTS.codec, "llama", (2, 7), None))
    with pytest.raises(ValueError, match="differs from what its workload was made from"):
        he.load("a test")
    assert he.model is None


def test_without_hf_alone_the_kept_reference_is_the_agreements(light):
    he = light.load_he(2, 2, "m")
    _kept(he, 1, [[1, 2], [4]], 5.0)
    _kept(he, 2, [[1, 2, 3], [4, 5]], 3.0)  # the faster: hf-alone's best of its read-back runs
    kept = light.kept_reference(he, [1, 2])
    assert kept.outputs == [[1, 2, 3], [4, 5]] and kept.threads == 2
    runs = [Run("slotserve-broker[gguf]", wall_s=1.0, outputs=[[1, 2, 3], [4, 6]], first_s=[0.1, 0.1],
                last_s=[0.2, 0.2])]
    extra = {}
    rows, _ = light.summary_rows(runs, he, None, extra, kept)
    assert rows[0]["identical_to_hf_greedy"] == 1 and rows[0]["differs_from_reference"] == [1]
    assert extra["agreement_reference"] == "hf-alone"
    assert extra["agreement_note"].startswith("hf-alone did not run: its kept outputs are the reference")
    table = light.served_table(rows, 2, extra["agreement_reference"], None, extra["agreement_note"])
    assert table[0]["identical_to_reference"] == 1 and table[0]["reference_note"] == extra["agreement_note"]


def test_without_a_reference_the_agreement_is_blank_and_the_table_says_why(light, capsys):
    he = light.load_he(2, 2, "m")
    assert light.kept_reference(he, [1, 2]) is None
    runs = [Run("slotserve-broker[gguf]", wall_s=1.0, outputs=[[1], [4]], first_s=[0.1, 0.1], last_s=[0.2, 0.2])]
    extra = {}
    rows, _ = light.summary_rows(runs, he, None, extra, None)
    assert rows[0]["identical_to_hf_greedy"] is None and extra["agreement_reference"] is None
    assert "hf-alone's outputs for m, this workload and these thread counts are not kept" in extra["agreement_note"]
    light.print_served(light.served_table(rows, 2, None, None, extra["agreement_note"]), "m")
    out = capsys.readouterr().out
    assert "= reference" in out and "not kept" in out and "None/2" not in out


def test_a_run_without_hf_alone_and_limits_loads_no_model(light, monkeypatch, tmp_path):
    """``--systems slotserve-broker --no-limits``: the workload without the model, the agreement column
    from the kept reference (read back, not run)."""
    reported = {}
    chosen = []

    def run_systems(he, precisions, args, thread_counts, skip):
        chosen.append(set(model.ALL_SYSTEMS) - skip)
        return [Run("slotserve-broker[gguf]", wall_s=1.0, outputs=[[1, 2, 3], [4, 5]], first_s=[0.1, 0.1],
                    last_s=[0.2, 0.2])]

    def report(rows, limits, ideal_s, out, extra, name, machine):
        reported.update(rows=rows, limits=limits, extra=extra)

    monkeypatch.setattr(model, "run_systems", run_systems)
    monkeypatch.setattr(model, "report", report)
    monkeypatch.setattr(model, "step_weights_mib", lambda name, system: None)
    _kept(model.load_he(2, 2, "m"), 2, [[1, 2, 3], [4, 6]], 3.0)
    monkeypatch.setattr(sys, "argv", ["bench.model", "--model", "m", "--systems", "slotserve-broker",
                                      "--precisions", "gguf", "--prompts", "2", "--no-limits",
                                      "--out", str(tmp_path)])
    model.main()  # (load_model raises)
    assert chosen == [{"slotserve-broker"}]
    assert reported["limits"] is None
    assert reported["rows"][0]["identical_to_hf_greedy"] == 1
    assert reported["extra"]["served"][0]["reference"] == "hf-alone"


# ------------------------------------------------------------------ the facts without the weights


def _folders(tiny_text_dir, tmp_path) -> dict[str, str]:
    """The tiny text model as saved (its generation_config.json), with another generation config (its
    own EOS and pad ids), and without one (transformers' from its config.json)."""
    import json

    out = {"saved": tiny_text_dir}
    for kind in ("own generation config", "no generation config"):
        folder = tmp_path / kind.replace(" ", "-")
        shutil.copytree(tiny_text_dir, folder)
        gen = folder / "generation_config.json"
        if kind == "no generation config":
            gen.unlink(missing_ok=True)
        else:
            gen.write_text(json.dumps({"eos_token_id": [2, 5], "pad_token_id": 7, "bos_token_id": 1}))
        out[kind] = str(folder)
    return out


@pytest.mark.parametrize("kind", ["saved", "own generation config", "no generation config", "gguf"])
def test_the_facts_read_without_the_weights_are_the_loaded_models(tiny_text_dir, tmp_path, kind):
    from worker.models import load_model

    if kind == "gguf":
        pytest.importorskip("gguf")
        from tests.support.tiny_gguf import write_quantized_gguf

        name = str(tmp_path / "m.gguf")
        write_quantized_gguf(name, specials=("<|im_end|>",))  # (an end-of-generation token besides EOS)
    else:
        name = _folders(tiny_text_dir, tmp_path)[kind]
    light = model.model_facts(name)
    loaded = model.runner_facts(load_model(name, runner="hf", num_threads=1))
    assert (light.model_type, set(light.eos_ids), light.pad_id) == (loaded.model_type, set(loaded.eos_ids),
                                                                    loaded.pad_id)
    text = "def f(x):\n    return x  # the cat"
    assert light.codec.encode(text) == loaded.codec.encode(text)
    if kind == "own generation config":
        assert {2, 5} <= set(light.eos_ids) and light.pad_id == 7
    if kind == "gguf":  # (the file's end-of-generation tokens, as llama.cpp's, besides its EOS)
        assert light.codec._tok.convert_tokens_to_ids("<|im_end|>") in light.eos_ids
