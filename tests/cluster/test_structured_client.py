"""Structured outputs through a live cluster (broker + a worker process serving the tiny text model):
the same ``structured`` option from ``Client.submit_request``, ``AsyncClient.stream`` and
``slotserve run`` JSONL rows; a spec that does not compile is that request's ``bad_request`` and
its neighbours are served."""

from __future__ import annotations

import asyncio
import io
import json
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from client import AsyncClient, Client  # noqa: E402
from gateway import GatewayConfig  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from slotserve.job import run_job  # noqa: E402
from tests.support.gateway import start_cluster  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "y"]}}}


@pytest.fixture(scope="module")
def cluster(tiny_text_dir):
    c = start_cluster((WorkerConfig(model=tiny_text_dir, num_slots=4),), gateway=GatewayConfig(port=0),
                      models=(tiny_text_dir,))
    try:
        yield c
    finally:
        c.stop()


def test_the_client_takes_the_option_and_a_bad_spec_fails_alone(cluster, tiny_text_dir):
    with Client(cluster.frontend, model=tiny_text_dir) as client:
        ok = client.submit_request("hello", 40, structured={"json_schema": SCHEMA})
        bad = client.submit_request("hello", 8, structured={"regex": "a(b"})
        word = client.submit_request([{"role": "user", "content": "hi"}], 12, structured={"regex": "[a-z]{3,5}"},
                                     temperature=0.9, seed=1)
        client.run()
    assert ok.finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(ok.text), SCHEMA)
    assert bad.finish_reason == FinishReason.ERROR and bad.error.code == ErrorCode.BAD_REQUEST
    assert "does not compile" in bad.error.message
    assert word.finish_reason == FinishReason.STOP and re.fullmatch("[a-z]{3,5}", word.text)
    with pytest.raises(ValueError, match="structured choice"):  # the edge's check, before sending
        Client(cluster.frontend, model=tiny_text_dir).submit_request("hello", 4, structured={"choice": []})


def test_an_async_stream_and_jsonl_rows(cluster, tiny_text_dir):
    async def streamed():
        async with await AsyncClient.connect(cluster.frontend, model=tiny_text_dir) as client:
            return "".join([piece async for piece in client.stream_text("hello", 20,
                                                                        structured={"choice": ["left", "right"]})])

    assert asyncio.run(streamed()) in ("left", "right")
    rows = [{"id": 1, "prompt": "hello", "max_tokens": 40, "structured": {"json_schema": SCHEMA}},
            {"id": 2, "prompt": "hello", "max_tokens": 8, "structured": {"gbnf": 'root ::= "on" | "off"'}},
            {"id": 3, "prompt": "hello", "max_tokens": 8, "structured": {"choice": []}}]
    out = io.StringIO()
    with Client(cluster.frontend, model=tiny_text_dir) as client:
        run_job(client, io.StringIO("\n".join(json.dumps(r) for r in rows) + "\n"), out, progress=False,
                timeout_s=120)
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    jsonschema.validate(json.loads(got[1]["text"]), SCHEMA)
    assert got[2]["text"] in ("on", "off") and got[2]["finish_reason"] == "stop"
    assert got[3]["finish_reason"] == "error" and "structured choice" in got[3]["error"]["message"]
