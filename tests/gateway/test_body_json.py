"""A body that is not valid JSON, on every route that reads one (the gateway's whole app, no broker:
every body is read before the broker is asked anything). A string escape of half a UTF-16 surrogate
pair (``"\\ud800"`` alone) was answered in the parser's words, "unexpected end of hex escape" (or
"lone leading surrogate" for a trailing half), and ``/models/load`` took it and failed to answer
(its 404 could not be written as UTF-8): each route now says what and where it is, in its own
error shape."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.errors import invalid_json  # noqa: E402
from tests.support.cluster import free_port  # noqa: E402

ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def app():
    config = GatewayConfig(broker=f"tcp://127.0.0.1:{free_port()}", connect_timeout_s=0.5,
                           on_demand_models=("lazy",))
    return create_app(config)


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app) as c:
        yield c


def post_routes(app) -> list[str]:
    """Every path of the app that takes a POST: each reads a JSON body."""
    return sorted({r.path for r in app.routes if "POST" in (r.methods or ())})


def test_every_post_route_is_covered(app):
    assert set(ANTHROPIC) <= set(post_routes(app)) and {"/v1/completions", "/models/load", "/infill"} <= \
        set(post_routes(app))


def error_message(r, path: str) -> str:
    """The message of a 400 in the route's error shape: Anthropic's on the Messages API, else OpenAI's
    with the code ``invalid_json`` and no ``param``."""
    assert r.status_code == 400, (path, r.text)
    body = r.json()
    if path in ANTHROPIC:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == \
        ("invalid_request_error", None, "invalid_json"), body
    return body["error"]["message"]


@pytest.mark.parametrize("raw, escape", [
    (b'{"model": "lazy", "prompt": "\\ud800", "x": 1}', "\\ud800"),                # a high half at the end
    (b'{"model": "lazy", "prompt": "ab\\udc00"}', "\\udc00"),                      # a low half alone
    (b'{"model": "lazy", "prompt": "\\uD83D\\u0041"}', "\\uD83D"),                 # a high half, no low one next
    (b'{"model": "lazy", "prompt": "\\ud83d\\ude00 \\\\ud800 \\udbff"}', "\\udbff"),  # a pair, an escaped
])                                                                                # backslash, then a lone half
def test_a_lone_surrogate_escape_is_named_with_its_place_on_every_route(app, http, raw, escape):
    column = raw.decode().index(escape) + 1  # (each escape is once in its body, on line 1)
    for path in post_routes(app):
        message = error_message(http.post(path, content=raw, headers={"content-type": "application/json"}), path)
        assert message == (f"the body is not valid JSON: it contains an unpaired surrogate escape '{escape}' at "
                           f"line 1 column {column} (half of a UTF-16 surrogate pair, which is no character); send "
                           "the character itself as UTF-8, or both halves of its pair"), (path, message)


def test_the_line_and_column_are_counted_in_characters_on_later_lines():
    raw = '{\n  "model": "é",\n  "input": ["ok", "é\\ud800"]\n}'.encode()
    assert "at line 3 column 21 " in invalid_json(raw, "").message
    assert raw.decode().splitlines()[2][20:26] == "\\ud800"


def test_a_syntax_error_before_a_lone_surrogate_is_the_one_named_and_a_pair_is_no_error(app, http):
    for path in post_routes(app):
        r = http.post(path, content=b'{"model": "lazy" "prompt": "\\ud800"}', headers={"content-type": "application/json"})
        message = error_message(r, path)
        assert "surrogate" not in message and message.startswith("the body is not valid JSON at line 1 ") and \
            "Invalid JSON" not in message, (path, message)  # (pydantic's prefix, said twice before)
        paired = http.post(path, content=b'{"model": "lazy", "prompt": "\\ud83d\\ude00"}',
                           headers={"content-type": "application/json"})
        assert "not valid JSON" not in paired.text, (path, paired.text)


# ---------------------------------------------------------------------- every other way a body is no JSON object

PARSER_WORDS = ("Invalid JSON", "EOF", "recursion", "ident", "`", "unicode code point", "trailing characters",
                "hex escape")  # (pydantic's JSON parser's own: never in a message)
BAD = {  # name -> (body, the message, or its start where a place follows)
    "syntax": (b'{"model": "lazy" "prompt": "x"}',
               "the body is not valid JSON at line 1 column 18: expected ',' or '}' in an object"),
    "syntax_after_accents": ('{"model": "\u00e9\u00e9\u00e9\u00e9" x}'.encode(),
                             "the body is not valid JSON at line 1 column 18: expected ',' or '}' in an object"),
    "second_line": (b'{\n  "model": "lazy",\n  "n": tru, "x": 1\n}', "the body is not valid JSON at line 3 column 11: expected a "
                    "value (true, false and null are lower case)"),
    "trailing": (b'{"model": "lazy"} x', "the body is not valid JSON at line 1 column 19: more text after the JSON value"),
    "trailing_comma": (b'{"model": "lazy",}', "the body is not valid JSON at line 1 column 18: a comma before the "
                       "closing bracket"),
    "cut_in_a_string": (b'{"model": "la', "the body is not valid JSON at line 1 column 13: it ends inside a string"),
    "cut_in_an_object": (b'{"model": "lazy"', "the body is not valid JSON at line 1 column 16: it ends inside an object"),
    "key_not_string": (b'{model: 1}', "the body is not valid JSON at line 1 column 2: an object's key must be a string"),
    "control_char": (b'{"model": "a\x01b"}', "the body is not valid JSON at line 1 column 13: a string holds a control "
                     "character (U+0000 to U+001F); write it as an escape (\\n, \\t, \\u0001)"),
    "bad_escape": (b'{"model": "\\x41"}', "the body is not valid JSON at line 1 column 13: a string holds an invalid "
                   "escape (JSON's are \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)"),
    "huge_integer": (b'{"model": "lazy", "n": 1' + b"0" * 5000 + b"}",
                     "the body is not valid JSON at line 1 column 4325: a number too large to read"),
    "nested_in_a_field": (b'{"model": "lazy", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                          "the body nests arrays and objects more than 200 levels deep (at line 1 column 229); "
                          "slotserve reads at most 200 levels inside the body's object"),
    "latin1": ('{"model": "caf\u00e9"}'.encode("latin-1"), "the body is not valid UTF-8: byte 0xe9 at line 1 column 15 "
               "(byte 15); send the JSON encoded in UTF-8"),
    "bad_utf8_in_a_key": (b'{"mo\xc3del": "lazy"}', "the body is not valid UTF-8: byte 0xc3 at line 1 column 5 (byte 5);"
                          " send the JSON encoded in UTF-8"),
    "bad_utf8_after_accents": ('{"model": "\u00e9",\n "x": "'.encode() + b'\xff"}',
                               "the body is not valid UTF-8: byte 0xff at line 2 column 8 (byte 24); send the JSON "
                               "encoded in UTF-8"),
    "empty": (b"", "the body is empty: send a JSON object"),
    "blank": (b" \n\t ", "the body is empty: send a JSON object"),
}
NOT_OBJECTS = {b"[1, 2]": "an array", b'"hi"': "a string", b"5": "a number", b"null": "null", b"true": "a boolean",
               b"{}": None,
               # an array nested past the parser's 200 levels said 'the body nests arrays and objects more than 200
               # levels deep (at line 1 column 202); slotserve reads at most 200 levels inside the body's object',
               # and was invalid_json: there is no body's object; that it is none is what to fix
               b"[" * 202 + b"]" * 202: "an array", b"[" * 5000 + b"]" * 5000: "an array", b"[" * 5000: "an array",
               b"\xef\xbb\xbf \n[" + b"[" * 300 + b"]" * 300 + b"]": "an array"}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_body_that_is_no_json_is_told_in_slotserve_s_words_on_every_route(app, http, name):
    # the parser's words were the message: 'the body is not valid JSON: recursion limit exceeded at line 1 column
    # 202', 'EOF while parsing a value at line 1 column 0' for an empty body, 'invalid unicode code point' for
    # bytes that are no UTF-8, a column counted in bytes after accented letters
    raw, want = BAD[name]
    for path in post_routes(app):
        message = error_message(http.post(path, content=raw, headers={"content-type": "application/json"}), path)
        assert message == want, (path, message)
        assert not any(w in message for w in PARSER_WORDS), (path, message)


@pytest.mark.parametrize("raw", sorted(NOT_OBJECTS))
def test_json_that_is_no_object_says_what_it_is(app, http, raw):
    for path in post_routes(app):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        if NOT_OBJECTS[raw] is None:  # ({}: an object, its fields missing or defaults)
            assert "not valid JSON" not in r.text and "must be a JSON object" not in r.text, (path, r.text)
            continue
        assert r.status_code == 400, (path, r.text)
        body = r.json()
        message = body["error"]["message"]
        assert message == f'the body must be a JSON object ({{"model": ...}}), got {NOT_OBJECTS[raw]}', (path, message)
        if path not in ANTHROPIC:
            assert (body["error"]["param"], body["error"]["code"]) == (None, "invalid_type"), body


def test_the_depth_the_parser_reads_is_the_one_the_message_gives(app, http):
    from gateway.json_body import MAX_DEPTH

    def nested(levels: int) -> bytes:
        return b'{"model": "lazy", "x": ' + b"[" * levels + b"]" * levels + b"}"

    for path in ("/v1/completions", "/v1/messages"):
        assert "levels deep" not in http.post(path, content=nested(MAX_DEPTH), headers=JSON).text
        assert f"more than {MAX_DEPTH} levels deep" in http.post(path, content=nested(MAX_DEPTH + 1), headers=JSON).text


def test_a_byte_order_mark_before_the_json_is_ignored(app, http):
    # (RFC 8259 section 8.1 lets a parser ignore it, as Python's json.loads and slotserve run do): it was
    # 'the body is not valid JSON: expected value at line 1 column 1'
    raw = b'{"model": "lazy", "unknown_field": 1}'
    for path in post_routes(app):
        with_mark = http.post(path, content=b"\xef\xbb\xbf" + raw, headers=JSON)
        assert "not valid JSON" not in with_mark.text, (path, with_mark.text)
        assert with_mark.json() == http.post(path, content=raw, headers=JSON).json(), path


JSON = {"content-type": "application/json"}
