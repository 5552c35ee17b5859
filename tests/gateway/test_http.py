"""The HTTP gateway at the HTTP level (httpx and raw sockets), against a live cluster.

Bad bodies (malformed JSON, wrong types, unknown fields, over the size
limit), a full queue (429), clients that disconnect (their requests are
cancelled: checked in the broker's own status, not by waiting), no broker
(503), and ``slotserve serve`` as a command.

The cluster's one worker is slow on purpose (2 slots, 20 ms per iteration)
and its broker queue holds 3 requests, so the queue can be filled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from gateway import GatewayConfig, run
from protocol.request import RequestParams
from tests.support.cluster import free_port
from tests.support.gateway import broker_status, error_of, metric, start_cluster, wait_until
from tests.support.reference import simulated_reference
from worker.config import WorkerConfig

BODY_LIMIT = 64 * 1024
SLOTS, PREFETCH, MAX_QUEUE = 2, 1, 3
LONG = {"model": "simulated", "prompt": [1, 2], "max_tokens": 5000, "ignore_eos": True}  # ~100 s at 20 ms/token


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster((WorkerConfig(num_slots=SLOTS, prefetch=PREFETCH, step_delay_ms=20.0),), max_queue=MAX_QUEUE,
                      gateway=GatewayConfig(port=0, max_body_bytes=BODY_LIMIT))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.http_url, timeout=30) as c:
        yield c


def idle(cluster):
    """True when the broker holds no request for the model and every slot is free."""
    m = broker_status(cluster).models["simulated"]
    return m.queued == 0 and m.running == 0 and m.slots_busy == 0


# ---------------------------------------------------------------------- bad bodies


def dumps(**fields) -> bytes:
    return json.dumps({"model": "simulated", "prompt": [1, 2], "max_tokens": 2, **fields}).encode()


@pytest.mark.parametrize("body, param, code", [
    (b'{"model": "simulated", "prompt": [1, 2', None, "invalid_json"),
    (b"\xff\xfe not json", None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_type"),
    # (no model: the one served; with several, a 400 naming them: tests/gateway/test_model_optional.py)
    (b'{"model": "simulated"}', "prompt", "missing_required_parameter"),
    (dumps(max_tokens="5"), "max_tokens", "invalid_type"),
    (dumps(max_tokens=2.5), "max_tokens", "invalid_type"),
    (dumps(temperature=True), "temperature", "invalid_type"),
    (dumps(stream="yes"), "stream", "invalid_type"),
    (dumps(prompt=[1, "a"]), "prompt", "invalid_type"),
    (dumps(prompt={"text": "hi"}), "prompt", "invalid_type"),
    (dumps(n=0), "n", "invalid_value"),
    (dumps(seed=-1), "seed", "invalid_value"),
    (dumps(stop=[[1], [2], [3], [4], [5]]), "stop", "invalid_value"),
    (dumps(stop=[[]]), "stop", "invalid_value"),
    (dumps(prompt=[]), "prompt", "invalid_value"),
    (dumps(prompt=[-1]), "prompt", "invalid_value"),
    (dumps(temperatur=0.5), "temperatur", "unknown_parameter"),
    (dumps(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (dumps(stream=True, stream_options={"include_usage": True, "extra": 1}), "stream_options.extra",
     "unknown_parameter"),
    (dumps(metadata={f"k{i}": "x" for i in range(17)}), "metadata", "invalid_value"),  # (OpenAI's bounds: 16 keys,
    (dumps(metadata={"k" * 65: "x"}), "metadata", "invalid_value"),                     # keys of 64 characters,
    (dumps(metadata={"k": "x" * 513}), "metadata", "invalid_value"),                    # values of 512)
    (dumps(metadata={"k": 5}), "metadata.k", "invalid_type"),
])
def test_bad_completion_bodies_are_400(http, body, param, code):
    e = error_of(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert (e["param"], e["code"], e["type"]) == (param, code, "invalid_request_error"), e


@pytest.mark.parametrize("prompt, index", [(["ab", ""], 1), (["", "ab"], 0), ([[1], []], 1), ([[], [2]], 0)])
def test_an_empty_prompt_among_several_is_named(http, prompt, index):
    # ["ab", ""] was refused only when its second prompt reached the wire ("prompt must not be empty",
    # no index: the first already sent, then cancelled); now named from the body, before any is sent
    e = error_of(http.post("/v1/completions", json={"model": "simulated", "max_tokens": 2, "prompt": prompt}), 400)
    assert (e["param"], e["code"]) == ("prompt", "invalid_value"), e
    assert e["message"] == f"prompt[{index}] must not be empty", e


@pytest.mark.parametrize("path, fields, param, says", [
    ("/v1/completions", {"prompt": [1, 2.0]}, "prompt", "token ids must be integers: prompt[1] is 2.0"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt", "token ids must be integers: prompt[1] is true"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4.5]]}, "prompt", "token ids must be integers: prompt[1][1] is 4.5"),
    ("/v1/completions", {"prompt": [1, [2]]}, "prompt", "a list of token-id lists, not a mix"),
    ("/v1/completions", {"prompt": 5}, "prompt", "prompt must be a string, a list of token ids"),
    ("/v1/completions", {"stop_token_ids": [7, 8.0]}, "stop_token_ids",
     "token ids must be integers: stop_token_ids[1] is 8.0"),
    ("/v1/completions", {"stop": [[1, 2.0]]}, "stop", "token ids must be integers: stop[0][1] is 2.0"),
    ("/v1/completions", {"stop": ["x", 3]}, "stop", "stop entries must be strings or lists of token ids: stop[1] is 3"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [1.5]},
     "stop_token_ids", "token ids must be integers: stop_token_ids[0] is 1.5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [[3, 4.0]]},
     "stop", "token ids must be integers: stop[0][1] is 4.0"),
])
def test_a_wrong_entry_of_a_token_id_list_is_named(http, path, fields, param, says):
    # "prompt": [1, 2.0] was answered "Input should be a valid string (got list)": the error of the
    # union's first member; stop_token_ids named "stop_token_ids.1" as the field
    body = {"model": "simulated", "max_tokens": 2, **({} if "messages" in fields else {"prompt": [1, 2]}), **fields}
    e = error_of(http.post(path, json=body), 400)
    assert (e["param"], e["code"], e["type"]) == (param, "invalid_type", "invalid_request_error"), e
    assert says in e["message"], e


@pytest.mark.parametrize("fields, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),  # (OpenAI's rule: only the assistant's may be null)
    ({"messages": [{"role": "assistant"}, {"role": "tool"}]}, "messages.1.content"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user<|im_end|>", "content": "x"}]}, "messages.0.role"),  # (template markup)
    ({"messages": [{"role": "user\nsystem", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {f"k{i}": "x" for i in range(17)}}, "metadata"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "mood": "ok"}]}, "messages.0.mood"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"messages": [], "max_tokens": 2}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3},
     "max_completion_tokens"),
])
def test_bad_chat_bodies_are_400(http, fields, param):
    r = http.post("/v1/chat/completions", json={"model": "simulated", **fields})
    e = error_of(r, 400)
    if param is not None:
        assert e["param"] == param, e


@pytest.mark.parametrize("role", ["user<|im_end|>", "", "1st", "a" * 33, "naïve"])
def test_a_role_is_refused_over_http_by_the_rule_the_sdk_applies(http, role):
    """One rule for roles (protocol.validation.as_role): HTTP's 400 says what the Python SDK's
    ValueError says, the message's index in ``param`` there, in the words here."""
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    with pytest.raises(ValueError) as sdk:
        RequestParams(messages, 2)
    e = error_of(http.post("/v1/chat/completions", json={"model": "simulated", "messages": messages}), 400)
    assert e["param"] == "messages.1.role" and str(sdk.value) == f"chat message 1 {e['message']}", (e, sdk.value)


@pytest.mark.parametrize("prompts, n, param", [(1025, 1, "prompt"), (600, 2, "n")])
def test_too_many_choices_name_the_field_that_made_them(http, prompts, n, param):
    e = error_of(http.post("/v1/completions", content=dumps(prompt=[[1]] * prompts, n=n, max_tokens=1)), 400)
    assert e["param"] == param and "at most 1024" in e["message"], e


def test_metadata_at_openais_bounds_is_taken(http):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # 16 keys of 64 characters, values of 512
    r = http.post("/v1/completions", content=dumps(metadata=metadata))
    assert r.status_code == 200, r.text


def test_a_good_body_after_bad_ones_still_works(http):
    r = http.post("/v1/completions", content=dumps(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == simulated_reference([1, 2], 3, stop_token=None)[0]


def test_bodies_over_the_limit_are_413(http):
    big = dumps(user="x" * (BODY_LIMIT + 1))
    e = error_of(http.post("/v1/completions", content=big), 413)
    assert e["code"] == "request_too_large" and str(BODY_LIMIT) in e["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    e = error_of(http.post("/v1/completions", content=chunked()), 413)
    assert e["code"] == "request_too_large"
    assert http.post("/v1/completions", content=dumps(user="x" * (BODY_LIMIT // 2))).status_code == 200


def test_unknown_paths_and_methods_answer_in_the_error_shape(http):
    assert error_of(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(http.get("/v1/completions"), 405)["code"] == "method_not_allowed"


# ---------------------------------------------------------------------- full queue, disconnects


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """Send one HTTP request on a fresh connection and return the socket, unread."""
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_full_queue_is_429_and_disconnects_cancel_queued_and_running_requests(cluster, http):
    wait_until(lambda: idle(cluster), 30, "an idle cluster")
    cancelled = broker_status(cluster).counters.get("cancelled", 0)
    held = SLOTS + PREFETCH + MAX_QUEUE
    socks = [raw_request(cluster.http_url, "/v1/completions", {**LONG, "prompt": [i + 1, 2]}) for i in range(held)]
    try:
        def full():
            m = broker_status(cluster).models["simulated"]
            return m.running == SLOTS + PREFETCH and m.queued == MAX_QUEUE and m.slots_busy == SLOTS
        wait_until(full, 30, "2 requests running, 1 prefetched and 3 queued")
        r = http.post("/v1/completions", json={**LONG, "max_tokens": 1})
        e = error_of(r, 429)
        assert e["code"] == "queue_full" and e["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: idle(cluster), 30, "the disconnected clients' requests to be cancelled")
    assert broker_status(cluster).counters["cancelled"] - cancelled == held
    wait_until(lambda: metric(cluster.http_url, "slotserve_http_requests_in_flight") == 0, 10, "no HTTP request in flight")


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_leaving_a_stream_cancels_its_requests(cluster, http, n):
    wait_until(lambda: idle(cluster), 30, "an idle cluster")
    cancelled = broker_status(cluster).counters.get("cancelled", 0)
    gone = metric(cluster.http_url, "slotserve_http_requests_total", endpoint="/v1/completions", status="499")
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True, "n": n}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
        assert first["choices"][0]["token_ids"] and first["choices"][0]["finish_reason"] is None
        assert broker_status(cluster).models["simulated"].running == n
    # leaving the block closed the connection mid-stream
    wait_until(lambda: idle(cluster), 30, "the abandoned stream's requests to be cancelled")
    assert broker_status(cluster).counters["cancelled"] - cancelled == n
    assert metric(cluster.http_url, "slotserve_http_requests_total", endpoint="/v1/completions", status="499") == \
        gone + 1
    assert metric(cluster.http_url, "slotserve_http_requests_in_flight") == 0


# ---------------------------------------------------------------------- no broker, the command


def test_no_broker_is_503():
    """No broker: 503 at once once the gateway's first try to reach one failed (a request during
    that first try waits for it, up to connect_timeout_s; none waits after it)."""
    import time

    stop, ready = threading.Event(), []
    cfg = GatewayConfig(broker=f"tcp://127.0.0.1:{free_port()}", port=0, connect_timeout_s=3.0)
    t = threading.Thread(target=run, args=(cfg,), kwargs={"stop": stop, "on_ready": ready.append})
    t.start()
    try:
        url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
        with httpx.Client(base_url=url, timeout=10) as c:
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "unavailable"
            error_of(c.post("/v1/completions", json={"model": "m", "prompt": [1]}), 503)  # (the first try's end)
            for path, body in (("/v1/completions", {"model": "m", "prompt": [1]}),
                               ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})):
                t0 = time.monotonic()
                r = c.post(path, json=body)
                assert time.monotonic() - t0 < cfg.connect_timeout_s / 2  # not another connect timeout's wait
                e = error_of(r, 503)
                assert e["type"] == "service_unavailable_error" and "no slotserve broker" in e["message"]
                assert r.headers["retry-after"] == "1"
            assert c.get("/v1/models").status_code == 503
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()


def test_a_request_sent_as_the_gateway_starts_waits_for_its_first_answer_from_the_broker():
    """The gateway listens before its control connection has heard from the broker (a cluster just
    started, a loaded machine): a request in that window waits for the first answer (up to
    ``connect_timeout_s``) and is served, instead of a 503 "no broker" that a retry a moment later
    would not get. (CI once saw this: an on-demand request sent as the cluster came up never queued.)"""
    from broker import BrokerConfig
    from slotserve.launcher import ClusterConfig, LocalCluster
    from tests.support.cluster import ANY_PORT
    from tests.support.gateway import CallInFlight

    cluster = LocalCluster(ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                                         (WorkerConfig(num_slots=1, warmup=False),), start_timeout_s=60.0))
    cluster.start()
    stop, ready = threading.Event(), []
    t = None
    try:
        os.kill(cluster.broker_process.pid, signal.SIGSTOP)  # the broker answers nobody until SIGCONT
        t = threading.Thread(target=run, args=(GatewayConfig(broker=cluster.frontend, port=0, connect_timeout_s=60.0),),
                             kwargs={"stop": stop, "on_ready": ready.append})
        t.start()
        url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
        call = CallInFlight(url, "/v1/completions", {"model": "simulated", "prompt": [1, 2], "max_tokens": 3})
        # every other entry point that reads what the broker serves (refused 503 "no broker" at once before)
        models = []
        lister = threading.Thread(target=lambda: models.append(httpx.get(url + "/v1/models", timeout=60)))
        lister.start()
        others = {path: CallInFlight(url, path, body) for path, body in (
            ("/tokenize", {"model": "simulated", "prompt": "x"}),  # (simulated: no tokenizer, a 400)
            ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 2}))}  # (no model named)
        wait_until(lambda: call.done or metric(url, "slotserve_http_requests_in_flight") == 2, 10,
                   "the completion and the infill in the gateway")
        assert not call.done, (call.status, call.json)  # the broker has not answered yet: it waits
        assert not any(c.done for c in others.values()) and not models, {p: (c.status, c.json) for p, c in others.items()}
        os.kill(cluster.broker_process.pid, signal.SIGCONT)
        call.wait(60)
        assert call.status == 200, call.json
        assert len(call.json["choices"][0]["token_ids"]) == 3
        lister.join(60)
        assert models[0].status_code == 200 and [m["id"] for m in models[0].json()["data"]] == ["simulated"]
        for path, c in others.items():
            c.wait(60)
            assert c.status == 400 and "tokenizer" in c.json["error"]["message"], (path, c.json)  # past the link
    finally:
        os.kill(cluster.broker_process.pid, signal.SIGCONT)
        stop.set()
        if t is not None:
            t.join(30)
        cluster.stop()
    assert t is not None and not t.is_alive()


BIN = Path(sys.executable).parent


@pytest.mark.skipif(shutil.which("slotserve", path=str(BIN)) is None, reason="needs the slotserve command")
def test_slotserve_serve_command(cluster):
    port = free_port()
    env = dict(os.environ, SLOTSERVE_SERVE_BROKER=cluster.frontend)
    proc = subprocess.Popen([str(BIN / "slotserve"), "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy():
            assert proc.poll() is None, "slotserve serve exited"
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(healthy, 60, "slotserve serve's /health")
        r = httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": [4, 5], "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=30)
        assert r.json()["choices"][0]["token_ids"] == simulated_reference([4, 5], 3, stop_token=None)[0]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"http://127.0.0.1:{port}/v1" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.skipif(shutil.which("slotserve", path=str(BIN)) is None, reason="needs the slotserve command")
def test_slotserve_up_http_port_supervises_the_gateway():
    psutil = pytest.importorskip("psutil")
    port = free_port()
    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([str(BIN / "slotserve"), "up", "--workers", "1", "--slots", "2", "--http-port", str(port),
                             "--frontend", front, "--backend", back],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, "slotserve up exited"
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def gateway_pid():
        for child in psutil.Process(proc.pid).children():
            try:
                if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
                    return child.pid
            except psutil.Error:  # a child that just died
                continue
        return None

    try:
        wait_until(healthy, 60, "slotserve up's gateway")
        first = gateway_pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: gateway_pid() not in (None, first) and healthy(), 60, "the gateway to be restarted")
        r = httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": [8, 9], "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=30)
        assert r.json()["choices"][0]["token_ids"] == simulated_reference([8, 9], 4, stop_token=None)[0]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"HTTP on {url}/v1" in err and "restarting" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its children (a new session of their own)
        proc.communicate(timeout=30)
    with socket.socket() as s:  # every child is gone: the HTTP port is free again
        s.bind(("127.0.0.1", port))
