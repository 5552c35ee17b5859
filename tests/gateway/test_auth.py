"""API keys on the gateway (issue 22, item 3): ``Authorization: Bearer KEY`` on every
``/v1`` route, streamed ones included; 401 in OpenAI's shape; ``/health`` open;
``/metrics`` open unless it has keys of its own; keys never logged nor in a repr;
the CLI's three sources (--api-key, --api-key-file, SLOTSERVE_SERVE_API_KEY)."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from click.testing import CliRunner

from gateway import GatewayConfig, run
from tests.support.gateway import start_cluster, wait_until
from tests.support.reference import simulated_reference
from tests.support.launcher import record_clusters
from worker.config import WorkerConfig

KEY, OTHER_KEY = "sk-test-Kq3vZ8", "second.key_~+/9="
WRONG = "sk-test-WRONGxyz"
METRICS_KEY = "scrape-4f1c"

CHAT = [{"role": "user", "content": "hi"}]
ROUTES = [  # (method, path, body): every /v1 route, plain and streamed
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/simulated", None),
    ("POST", "/v1/completions", {"model": "simulated", "prompt": [1, 2], "max_tokens": 3}),
    ("POST", "/v1/completions", {"model": "simulated", "prompt": [1, 2], "max_tokens": 3, "stream": True}),
    ("POST", "/v1/chat/completions", {"model": "simulated", "messages": CHAT, "max_tokens": 3}),
    ("POST", "/v1/chat/completions", {"model": "simulated", "messages": CHAT, "max_tokens": 3, "stream": True}),
    ("GET", "/v1/no-such-route", None),
]
ROUTE_IDS = ["models", "model", "completions", "completions-stream", "chat", "chat-stream", "unknown"]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster((WorkerConfig(num_slots=4),), gateway=GatewayConfig(port=0, api_keys=(KEY, OTHER_KEY)))
    try:
        yield c
    finally:
        c.stop()


def call(url: str, method: str, path: str, body: dict | None, headers: dict | None = None) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as c:
        return c.request(method, path, json=body, headers=headers or {})


def refused(r: httpx.Response, sent: str | None = None) -> dict:
    """``r`` is OpenAI's 401 for a bad key (and does not show ``sent`` back)."""
    assert r.status_code == 401, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    e = body["error"]
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", None, "invalid_api_key"), e
    assert isinstance(e["message"], str) and "Bearer" in e["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    if sent is not None:
        assert sent not in r.text
    return e


@pytest.mark.parametrize("method, path, body", ROUTES, ids=ROUTE_IDS)
def test_every_v1_route_needs_a_key(cluster, method, path, body):
    url = cluster.http_url
    refused(call(url, method, path, body))
    refused(call(url, method, path, body, {"Authorization": f"Bearer {WRONG}"}), WRONG)
    refused(call(url, method, path, body, {"Authorization": f"Basic {KEY}"}))   # the key, another scheme
    refused(call(url, method, path, body, {"Authorization": "Bearer"}))         # no token (api_key="")
    refused(call(url, method, path, body, {"Authorization": f"Bearer {KEY}x"}), f"{KEY}x")
    refused(call(url, method, path, body, {"X-API-Key": KEY}))                  # only Authorization counts


@pytest.mark.parametrize("method, path, body", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("key", [KEY, OTHER_KEY])
def test_every_v1_route_serves_a_right_key(cluster, method, path, body, key):
    r = call(cluster.http_url, method, path, body, {"Authorization": f"Bearer {key}"})
    if path == "/v1/no-such-route":
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    elif path == "/v1/chat/completions":  # the simulated model has no tokenizer: the gateway's own 400, past the key
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported", r.text
    elif path == "/v1/models":
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["simulated"]
    elif path == "/v1/models/simulated":
        assert r.status_code == 200 and r.json()["id"] == "simulated"
    elif body.get("stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]", r.text
        tokens = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c["token_ids"]]
        assert tokens == simulated_reference([1, 2], 3)[0]
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == simulated_reference([1, 2], 3)[0]


def test_the_scheme_is_case_insensitive_and_spaces_before_the_key_are_ignored(cluster):
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}"):
        assert call(cluster.http_url, "GET", "/v1/models", None, {"Authorization": header}).status_code == 200


def test_the_openai_sdk_gets_authentication_error_or_its_answer(cluster):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=WRONG, max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model="simulated", prompt=[1, 2], max_tokens=3)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key" and WRONG not in str(e.value)
        with pytest.raises(openai.AuthenticationError):
            list(c.completions.create(model="simulated", prompt=[1, 2], max_tokens=3, stream=True))
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, max_retries=0) as c:
        r = c.completions.create(model="simulated", prompt=[1, 2], max_tokens=3)
        assert r.choices[0].token_ids == simulated_reference([1, 2], 3)[0]
        chunks = list(c.completions.create(model="simulated", prompt=[1, 2], max_tokens=3, stream=True))
        assert [t for ch in chunks for t in ch.choices[0].token_ids] == r.choices[0].token_ids


def test_health_and_metrics_stay_open_without_a_metrics_key(cluster):
    assert httpx.get(cluster.http_url + "/health").status_code == 200
    r = httpx.get(cluster.http_url + "/metrics")
    assert r.status_code == 200 and "slotserve_http_requests_total" in r.text


# ---------------------------------------------------------------------- a gateway in this process: metrics keys, logs


@pytest.fixture
def local_gateway(cluster):
    """Start a gateway on a thread of this process (its logs reach caplog) with the API key
    KEY and the metrics key METRICS_KEY; yields its URL."""
    stop, ready = threading.Event(), []
    cfg = GatewayConfig(broker=cluster.frontend, port=0, api_keys=(KEY,), metrics_api_keys=(METRICS_KEY,))
    t = threading.Thread(target=run, args=(cfg,), kwargs={"stop": stop, "on_ready": ready.append})
    t.start()
    try:
        url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 20, "the gateway's /health")
        yield url
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()


def test_metrics_key_guards_metrics_apart_from_the_api_keys(local_gateway):
    url = local_gateway
    refused(httpx.get(url + "/metrics"))
    refused(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}))  # an API key is not a scrape key
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert r.status_code == 200 and "slotserve_http_requests_total" in r.text
    refused(httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {METRICS_KEY}"}))  # nor the reverse
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


def test_keys_are_never_logged_nor_in_the_configs_repr(local_gateway, caplog):
    caplog.set_level(logging.DEBUG)
    url = local_gateway
    for key in (KEY, WRONG, METRICS_KEY, "sk-another-wrong"):
        for path in ("/v1/models", "/metrics"):
            httpx.get(url + path, headers={"Authorization": f"Bearer {key}"})
    httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": [1], "max_tokens": 2},
               headers={"Authorization": f"Bearer {WRONG}"})
    assert "401 for GET /v1/models" in caplog.text  # the refusals are logged ...
    for key in (KEY, WRONG, METRICS_KEY, "sk-another-wrong"):  # ... without a key
        assert key not in caplog.text
    cfg = GatewayConfig(api_keys=(KEY, OTHER_KEY), metrics_api_keys=(METRICS_KEY,))
    for text in (repr(cfg), str(cfg)):
        assert KEY not in text and OTHER_KEY not in text and METRICS_KEY not in text


def test_a_bad_key_is_refused_at_start_without_showing_it():
    for bad in ("has space", "", "ünïcode", "colon:key", "semi;", "pad=in=middle"):
        with pytest.raises(ValueError, match=r"api_keys\[1\] is not a usable API key") as e:
            GatewayConfig(api_keys=(KEY, bad))
        assert not bad or bad not in str(e.value)
    with pytest.raises(ValueError, match="tuple of strings"):
        GatewayConfig(api_keys=KEY)  # a bare string, not one key per character


# ---------------------------------------------------------------------- the CLI's key sources


@pytest.fixture
def served(monkeypatch):
    """`slotserve serve` with gateway.run stubbed: the configs it would have served."""
    import gateway

    got = []

    def fake_run(cfg, *, stop=None, halt=None, on_ready=None, load_tokenizer=None):
        got.append(cfg)
        on_ready("http://127.0.0.1:1")

    monkeypatch.setattr(gateway, "run", fake_run)
    return got


def serve(args: list[str], env: dict | None = None):
    from slotserve.cli import main

    return CliRunner().invoke(main, ["serve", *args], env=env)


def test_cli_keys_come_from_flags_files_and_the_variable(served, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the team's keys\n\n  {OTHER_KEY}  \nfile-key-2\n")
    r = serve(["--api-key", KEY, "--api-key-file", str(keys), "--metrics-api-key", METRICS_KEY])
    assert r.exit_code == 0, r.output
    assert served[-1].api_keys == (KEY, OTHER_KEY, "file-key-2") and served[-1].metrics_api_keys == (METRICS_KEY,)
    assert "3 API key(s) required" in r.output
    outputs = [r.output]
    r = serve([], env={"SLOTSERVE_SERVE_API_KEY": f"{KEY} {OTHER_KEY}", "SLOTSERVE_SERVE_METRICS_API_KEY": "m1"})
    assert r.exit_code == 0, r.output
    assert served[-1].api_keys == (KEY, OTHER_KEY) and served[-1].metrics_api_keys == ("m1",)
    r2 = serve([], env={"SLOTSERVE_SERVE_API_KEY_FILE": str(keys)})
    assert r2.exit_code == 0 and served[-1].api_keys == (OTHER_KEY, "file-key-2")
    r3 = serve([])
    assert r3.exit_code == 0 and served[-1].api_keys == () and "API key" not in r3.output
    for out in outputs + [r.output, r2.output]:
        assert KEY not in out and OTHER_KEY not in out and METRICS_KEY not in out


def test_cli_refuses_unusable_keys_and_empty_key_files_without_showing_them(served, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{KEY}\nsecret with spaces\n")
    for args, says in ((["--api-key", "<REPLACE-me>"], "key 1 given is not a usable API key"),
                       (["--api-key-file", str(empty)], "holds no key"),  # never a gateway left open by mistake
                       (["--api-key-file", str(bad)], "line 2 is not a usable API key"),
                       (["--api-key-file", str(tmp_path / "missing.txt")], "cannot read"),
                       (["--metrics-api-key", "a:b"], "--metrics-api-key")):
        r = serve(args)
        assert r.exit_code == 2 and says in r.output, (args, r.output)
        assert "REPLACE-me" not in r.output and "with spaces" not in r.output and KEY not in r.output
    assert served == []


def test_up_takes_the_same_key_options(monkeypatch, tmp_path):
    from slotserve.cli import main

    clusters = record_clusters(monkeypatch, http_url="http://127.0.0.1:3")
    keys = tmp_path / "keys.txt"
    keys.write_text(OTHER_KEY + "\n")
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--api-key", KEY, "--api-key-file", str(keys),
                                  "--metrics-api-key", METRICS_KEY])
    assert r.exit_code == 0, r.output
    assert clusters[-1].gateway.api_keys == (KEY, OTHER_KEY) and clusters[-1].gateway.metrics_api_keys == (METRICS_KEY,)
    r = CliRunner().invoke(main, ["up", "--http-port", "0"], env={"SLOTSERVE_UP_API_KEY": KEY})
    assert r.exit_code == 0 and clusters[-1].gateway.api_keys == (KEY,)
    r = CliRunner().invoke(main, ["up", "--api-key", KEY])  # no HTTP server to protect
    assert r.exit_code == 2 and "--http-port" in r.output and len(clusters) == 2


def test_a_refusals_log_line_cannot_be_forged_through_the_path(caplog):
    import asyncio

    from gateway.auth import APIKeys

    async def refuse(path: str) -> None:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": [], "client": ("127.0.0.1", 1)}
        await APIKeys(None, api_keys=(KEY,))(scope, receive, send)
        assert sent[0]["status"] == 401

    caplog.set_level(logging.INFO, logger="gateway.auth")
    asyncio.run(refuse("/v1/x\n2026-12-01 00:00:00,000 gateway.server ERROR forged"))  # GET /v1/x%0A2026...
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    assert "/v1/x%0A2026-12-01" in caplog.records[0].getMessage()


def test_cli_refuses_a_blank_key_variable_rather_than_serving_without_keys(served, tmp_path):
    for var in ("SLOTSERVE_SERVE_API_KEY", "SLOTSERVE_SERVE_API_KEY_FILE", "SLOTSERVE_SERVE_METRICS_API_KEY"):
        for blank in ("", "  \n"):  # a Secret or env file whose value is missing
            r = serve([], env={var: blank})
            assert r.exit_code == 2 and f"{var} is set but blank" in r.output, (var, r.output)
    assert served == []
    r = serve(["--api-key", KEY], env={"SLOTSERVE_SERVE_API_KEY": ""})  # the flag wins; the variable is unused
    assert r.exit_code == 0 and served[-1].api_keys == (KEY,)
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"\xef\xbb\xbf" + KEY.encode() + b"\r\n")  # Notepad's UTF-8: a byte-order mark, CRLF
    r = serve(["--api-key-file", str(keys)])
    assert r.exit_code == 0 and served[-1].api_keys == (KEY,), r.output
