"""Body headers a careless or hostile client sends (found by trying to break the gateway):
Content-Type twice, and a Content-Encoding the gateway does not decode. The header check
alone (no sockets); test_stream_details has the Content-Type cases over HTTP."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from gateway.errors import APIError
from gateway.generate import _check_json_body_headers


def check(*headers: tuple[str, str]) -> None:
    _check_json_body_headers(Headers(raw=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]))


@pytest.mark.parametrize("headers", [
    (("content-type", "application/json"), ("content-type", "text/plain")),  # before: the first one counted
    (("content-type", "text/plain"), ("content-type", "application/json")),
    (("content-type", "application/json"), ("content-encoding", "gzip")),  # before: read as JSON
    (("content-encoding", "identity, br"),),
    (("content-type", "application/json"), ("content-encoding", "identity"), ("content-encoding", "deflate")),
], ids=["json-then-text", "text-then-json", "gzip", "br-listed", "deflate-second"])
def test_a_doubled_content_type_or_an_encoded_body_is_refused(headers):
    with pytest.raises(APIError) as e:
        check(*headers)
    assert (e.value.status, e.value.code) == (400, "unsupported_media_type")


def test_plain_json_passes():
    check()
    check(("content-type", "Application/JSON; charset=utf-8"))
    check(("content-type", "application/json"), ("content-encoding", "identity"))
