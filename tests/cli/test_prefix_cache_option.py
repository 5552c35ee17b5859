"""--prefix-cache-mb on worker, up and run: parsed into ModelOptions.prefix_cache_mb, checked as usage."""

from __future__ import annotations

from click.testing import CliRunner

from slotserve.cli import main
from tests.support.launcher import record_clusters


def test_up_passes_the_budget_to_every_worker_and_defaults_to_the_machine(monkeypatch):
    clusters = record_clusters(monkeypatch)
    for args, env, want in ((["up", "--workers", "2"], {}, None),
                            (["up", "--prefix-cache-mb", "0"], {}, 0),
                            (["up", "--prefix-cache-mb", "256.5"], {}, 256.5),
                            (["up"], {"SLOTSERVE_UP_PREFIX_CACHE_MB": "64"}, 64)):
        clusters.clear()
        r = CliRunner().invoke(main, args, env=env)
        assert r.exit_code == 0, r.output
        (cfg,) = clusters
        assert [w.model_options.prefix_cache_mb for w in cfg.workers] == [want] * len(cfg.workers)


def test_a_negative_or_non_numeric_budget_is_a_usage_error(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [1, 2], "max_tokens": 2}\n')
    for cmd in (["worker"], ["up"], ["run", str(rows), "-o", str(tmp_path / "out.jsonl")]):
        for bad in ("-1", "lots", "nan", "inf"):
            r = CliRunner().invoke(main, [*cmd, "--prefix-cache-mb", bad])
            assert r.exit_code == 2 and ("--prefix-cache-mb" in r.output or "prefix_cache_mb" in r.output), \
                (cmd, bad, r.output)
    r = CliRunner().invoke(main, ["up", "--help"])
    assert "--prefix-cache-mb" in r.output and "0: off" in r.output
