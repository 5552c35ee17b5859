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


@pytest.mark.parametrize("charset", ["latin-1", "ISO-8859-1", '"utf-16"', "windows-1252"])
def test_a_charset_other_than_utf8_is_refused_by_name(charset):
    """JSON is UTF-8 (RFC 8259): a Latin-1 body was read as UTF-8 and refused as "invalid unicode
    code point", where the docs said charset parameters were fine (a break-it pass)."""
    with pytest.raises(APIError) as e:
        check(("content-type", f"application/json; charset={charset}"))
    assert (e.value.status, e.value.code) == (400, "unsupported_media_type")
    assert charset.strip('"') in e.value.message and "UTF-8" in e.value.message


def test_utf8_spelled_either_way_passes():
    for value in ("application/json; charset=UTF-8", 'application/json;charset="utf8"', "application/json; q=1"):
        check(("content-type", value))
