"""``slotserve up`` without ``--http-port`` runs the broker and workers alone (for the Python SDK and
``slotserve run --broker``), where llama-server, Ollama and vLLM serve HTTP by default: its banner said
the broker's endpoints and the workers, and a user coming from them was left with ``curl: (7) Failed to
connect to localhost port 8000``. The banner now says there is no HTTP server and which option starts
one. Over a stand-in cluster (tests/support/launcher.py): no process."""

from __future__ import annotations

from click.testing import CliRunner

from slotserve.cli import main
from tests.support.launcher import record_clusters


def test_without_http_port_the_banner_says_how_to_serve_http(monkeypatch):
    record_clusters(monkeypatch)
    r = CliRunner().invoke(main, ["up", "--workers", "1"])
    assert r.exit_code == 0, r.output
    banner = next(line for line in r.output.splitlines() if line.startswith("slotserve up: broker on"))
    assert ", no HTTP server (--http-port PORT serves the OpenAI API). " in banner, banner


def test_with_http_port_the_banner_gives_its_url(monkeypatch):
    record_clusters(monkeypatch, http_url="http://127.0.0.1:8000")
    r = CliRunner().invoke(main, ["up", "--workers", "1", "--http-port", "8000"])
    assert r.exit_code == 0, r.output
    banner = next(line for line in r.output.splitlines() if line.startswith("slotserve up: broker on"))
    assert ", HTTP on http://127.0.0.1:8000/v1. " in banner and "no HTTP server" not in banner, banner
