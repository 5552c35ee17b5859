"""--kv-cache-dtype and --max-model-len on worker, up and run: parsed into ModelOptions, checked as usage."""

from __future__ import annotations

from click.testing import CliRunner

from slotserve.cli import main
from tests.support.launcher import record_clusters


def test_up_passes_both_to_every_worker_with_their_defaults(monkeypatch):
    clusters = record_clusters(monkeypatch)
    for args, env, want in ((["up", "--workers", "2"], {}, ("auto", None)),
                            (["up", "--kv-cache-dtype", "bf16", "--max-model-len", "4096"], {}, ("bf16", 4096)),
                            (["up", "--kv-cache-dtype", "FP32"], {}, ("fp32", None)),
                            (["up"], {"SLOTSERVE_UP_KV_CACHE_DTYPE": "bf16", "SLOTSERVE_UP_MAX_MODEL_LEN": "2048"},
                             ("bf16", 2048))):
        clusters.clear()
        r = CliRunner().invoke(main, args, env=env)
        assert r.exit_code == 0, r.output
        (cfg,) = clusters
        got = [(w.model_options.kv_cache_dtype, w.model_options.max_model_len) for w in cfg.workers]
        assert got == [want] * len(cfg.workers), args


def test_bad_values_are_usage_errors(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [1, 2], "max_tokens": 2}\n')
    for cmd in (["worker"], ["up"], ["run", str(rows), "-o", str(tmp_path / "out.jsonl")]):
        for flag, bad in (("--max-model-len", "1"), ("--max-model-len", "lots"), ("--kv-cache-dtype", "fp8"),
                          ("--kv-cache-dtype", "int8")):
            r = CliRunner().invoke(main, [*cmd, flag, bad])
            assert r.exit_code == 2 and flag in r.output, (cmd, flag, bad, r.output)
    r = CliRunner().invoke(main, ["up", "--kv-cache-dtype", "bf16", "--runner", "hf"])
    assert r.exit_code == 2 and "needs the slotserve runner" in r.output, r.output
    r = CliRunner().invoke(main, ["up", "--help"])
    assert "--kv-cache-dtype" in r.output and "--max-model-len" in r.output and "8192" in r.output
