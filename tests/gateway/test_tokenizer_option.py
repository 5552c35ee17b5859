"""The gateway's tokenizer (issue 20 item 5): ``--tokenizer`` on ``serve`` and ``up`` (default: the model
``up`` serves; ``serve``: each served model's own name when it is a local model), and the CLI's loader
(slotserve/tokenizer.py) giving the model's own tokenizer, or None for a name that is no local model."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.support.launcher import record_clusters


@pytest.fixture
def served(monkeypatch):
    """`slotserve serve` with gateway.run stubbed: (config, load_tokenizer) per run."""
    import gateway

    got = []

    def fake_run(cfg, *, stop=None, halt=None, on_ready=None, load_tokenizer=None):
        got.append((cfg, load_tokenizer))
        on_ready("http://127.0.0.1:1")

    monkeypatch.setattr(gateway, "run", fake_run)
    return got


def test_serve_takes_a_tokenizer_and_defaults_to_each_models_own(served):
    from slotserve.cli import main
    from slotserve.tokenizer import explicit_loader, load_tokenizer

    r = CliRunner().invoke(main, ["serve", "--tokenizer", "smollm2-135m"])
    assert r.exit_code == 0, r.output
    assert served[-1][0].tokenizer == "smollm2-135m" and served[-1][1] is explicit_loader
    r = CliRunner().invoke(main, ["serve"], env={"SLOTSERVE_SERVE_TOKENIZER": "/models/x"})
    assert r.exit_code == 0 and served[-1][0].tokenizer == "/models/x"
    r = CliRunner().invoke(main, ["serve"])
    assert r.exit_code == 0 and served[-1][0].tokenizer is None and served[-1][1] is load_tokenizer
    r = CliRunner().invoke(main, ["serve", "--tokenizer", " "])
    assert r.exit_code == 2 and "tokenizer" in r.output


def test_up_gives_its_gateway_the_models_tokenizer(monkeypatch):
    from slotserve.cli import main

    clusters = record_clusters(monkeypatch, http_url="http://127.0.0.1:3")
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--model", "simulated"])
    assert r.exit_code == 0, r.output
    assert clusters[-1].gateway.tokenizer is None  # a simulated model has none
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--model", "smollm2-135m", "--served-model-name", "m"])
    assert r.exit_code == 0, r.output
    assert clusters[-1].gateway.tokenizer == "smollm2-135m"  # the model's, whatever it is served as
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--model", "smollm2-135m", "--tokenizer", "/t"])
    assert r.exit_code == 0 and clusters[-1].gateway.tokenizer == "/t"
    r = CliRunner().invoke(main, ["up", "--tokenizer", "/t"])  # no HTTP server to give it to
    assert r.exit_code == 2 and "--http-port" in r.output and len(clusters) == 3


def test_the_loader_gives_the_models_own_tokenizer(tiny_text_dir):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from slotserve.tokenizer import explicit_loader, load_tokenizer

    assert load_tokenizer("simulated") is None and load_tokenizer("org/not-local-model") is None
    tok = load_tokenizer(tiny_text_dir)
    ref = AutoTokenizer.from_pretrained(tiny_text_dir)
    assert tok.encode("hello world") == ref.encode("hello world")
    assert tok.encode("hello world", add_special_tokens=False) == ref.encode("hello world", add_special_tokens=False)
    ids = ref.encode("hello world")
    assert tok.decode(ids) == ref.decode(ids) and [tok.token_str(t) for t in ids] == [ref.decode([t]) for t in ids]
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        explicit_loader(str(tiny_text_dir) + "-missing")
