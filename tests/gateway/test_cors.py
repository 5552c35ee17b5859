"""CORS (vLLM's --allowed-origins, with Starlette's CORSMiddleware): a browser page of another origin
could not call the gateway (no CORS headers: its preflight OPTIONS was a 405, and with API keys a
401); now ``allowed_origins`` answers the preflight and marks the answers for the origins it names,
outside the key check (a preflight carries no key), and sends nothing without it (the default). The
CLI's options reach the config, vLLM's JSON list too. Over the app with no broker, no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from click.testing import CliRunner  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402

PAGE = "https://app.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
KEY = "k" * 32


def _app(**cors) -> TestClient:
    return TestClient(create_app(GatewayConfig(broker="tcp://127.0.0.1:1", api_keys=(KEY,), **cors)))


@pytest.mark.parametrize("origins", [(PAGE,), ("*",)])
def test_a_preflight_from_an_allowed_origin_is_answered_before_the_key_check(origins):
    with _app(allowed_origins=origins) as http:
        r = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] in (PAGE, "*")
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        answer = http.get("/v1/models", headers={"Origin": PAGE})  # (no key: the 401 is marked for the page too)
        assert answer.status_code == 401 and answer.headers["access-control-allow-origin"] in (PAGE, "*")


def test_no_cors_headers_by_default_or_for_another_origin():
    with _app() as http:
        r = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code != 200 and "access-control-allow-origin" not in r.headers
    with _app(allowed_origins=("https://other.example",), allowed_methods=("GET",)) as http:
        r = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("bad", [{"allowed_origins": "*"}, {"allowed_origins": ("",)}, {"allowed_methods": (" GET",)}])
def test_the_config_refuses_what_is_no_list_of_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        GatewayConfig(**bad)


@pytest.mark.parametrize("args, cors", [
    ([], {"allowed_origins": ()}),
    (["--allowed-origins", PAGE, "--allowed-origins", "https://b.example"],
     {"allowed_origins": (PAGE, "https://b.example")}),
    (["--allowed-origins", '["*"]', "--allowed-methods", "GET", "--allowed-methods", "POST"],
     {"allowed_origins": ("*",), "allowed_methods": ("GET", "POST")}),
])
def test_the_serve_options_reach_the_config(monkeypatch, args, cors):
    import gateway
    from slotserve.cli import main

    seen = {}
    monkeypatch.setattr(gateway, "run", lambda cfg, *a, **k: seen.setdefault("cfg", cfg))
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 0, result.output
    assert {k: getattr(seen["cfg"], k) for k in cors} == cors


@pytest.mark.parametrize("args, says", [(["--allowed-origins", "[1]"], "no JSON list"),
                                        (["--allowed-methods", "GET"], "need --allowed-origins")])
def test_the_serve_options_refuse_what_they_cannot_use(args, says):
    from slotserve.cli import main

    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 2 and says in result.output, result.output
