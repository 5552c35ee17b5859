"""--served-model-name and --warmup/--no-warmup (issue 22, items 2 and 5): one
definition for `slotserve worker`, `up` and `run`; they reach the workers'
config; `run` asks for the primary name; with `run --broker` a served name is
a usage error (the broker's workers have theirs)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from slotserve.cli import main
from tests.support.launcher import record_clusters


@pytest.fixture
def worker_configs(monkeypatch):
    """`slotserve worker` over a stand-in run_worker: the WorkerConfigs it was given."""
    import worker.process

    configs = []
    monkeypatch.setattr(worker.process, "run_worker", lambda cfg, stop=None: configs.append(cfg))
    return configs


@pytest.fixture
def cluster_configs(monkeypatch):
    """`slotserve up` over a stand-in LocalCluster: the ClusterConfigs it was given."""
    return record_clusters(monkeypatch)


def test_worker_takes_served_names_and_warmup(worker_configs):
    r = CliRunner().invoke(main, ["worker", "--model", "smollm2-135m", "--served-model-name", "small",
                                  "--served-model-name", "HuggingFaceTB/SmolLM2-135M-Instruct", "--no-warmup"])
    assert r.exit_code == 0, r.output
    cfg = worker_configs[-1]
    assert cfg.served_names == ("small", "HuggingFaceTB/SmolLM2-135M-Instruct") and cfg.warmup is False
    r = CliRunner().invoke(main, ["worker"], env={"SLOTSERVE_WORKER_SERVED_MODEL_NAME": "a b"})
    assert r.exit_code == 0, r.output
    assert worker_configs[-1].served_names == ("a", "b") and worker_configs[-1].warmup is True  # on by default
    r = CliRunner().invoke(main, ["worker", "--served-model-name", "a", "--served-model-name", "a"])
    assert r.exit_code == 2 and "served_model_names" in r.output


def test_up_passes_them_to_every_worker(cluster_configs):
    r = CliRunner().invoke(main, ["up", "--workers", "2", "--served-model-name", "m1", "--served-model-name", "m2",
                                  "--no-warmup"])
    assert r.exit_code == 0, r.output
    workers = cluster_configs[-1].workers
    assert len(workers) == 2 and all(w.served_names == ("m1", "m2") and not w.warmup for w in workers)
    r = CliRunner().invoke(main, ["up"])
    assert r.exit_code == 0 and cluster_configs[-1].workers[0].served_names == ("simulated",)


def test_run_asks_for_the_primary_name_and_refuses_one_with_a_broker(monkeypatch, tmp_path):
    import slotserve.batch

    seen = {}

    def run_batch(inp, out, *, model, cluster, **kwargs):
        seen["model"], seen["cluster"] = model, cluster
        inp.close()
        return slotserve.batch.BatchOutcome(None, 0)

    monkeypatch.setattr(slotserve.batch, "run_batch", run_batch)
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": [1, 2], "max_tokens": 2}\n')
    r = CliRunner().invoke(main, ["run", str(rows), "-o", str(tmp_path / "out.jsonl"), "--served-model-name", "job",
                                  "--served-model-name", "other"])
    assert r.exit_code == 0, r.output
    assert seen["model"] == "job" and seen["cluster"].workers[0].served_names == ("job", "other")
    out = tmp_path / "kept.jsonl"
    out.write_text("keep me")
    r = CliRunner().invoke(main, ["run", str(rows), "-o", str(out), "--broker", "tcp://127.0.0.1:1",
                                  "--served-model-name", "job"])
    assert r.exit_code == 2 and "--served-model-name" in r.output and out.read_text() == "keep me"


def test_chat_template_reaches_every_worker(worker_configs, cluster_configs, tmp_path):
    """--chat-template (issue 33, item 4) on `worker` and `up`, a file's path or the Jinja itself."""
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    r = CliRunner().invoke(main, ["worker", "--model", "smollm2-135m", "--chat-template", str(path)])
    assert r.exit_code == 0, r.output
    assert worker_configs[-1].model_options.chat_template == str(path)
    r = CliRunner().invoke(main, ["up", "--model", "smollm2-135m", "--workers", "2", "--no-warmup",
                                  "--chat-template", "{{ messages[0]['content'] }}"])
    assert r.exit_code == 0, r.output
    assert all(w.model_options.chat_template == "{{ messages[0]['content'] }}" for w in cluster_configs[-1].workers)
