"""vLLM's decoding extras a vLLM client sends: ``skip_special_tokens`` and
``spaces_between_special_tokens`` were a 400 "Unrecognized request argument supplied" on both
routes; now ``skip_special_tokens: true`` (vLLM's default, how the worker decodes) and either
``spaces_between_special_tokens`` (no effect on a fast tokenizer, in vLLM too) are taken, and
``skip_special_tokens: false`` is a 501 naming it. ``return_token_ids``, ``truncate_prompt_tokens``
and ``cache_salt`` stay a 400 naming the field (none can be honoured: docs/http-api.md). Over the
handlers app with a scripted broker client, no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.support.gateway import error_of  # noqa: E402

ROUTES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}, "/v1/completions": {"prompt": "hi"}}


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize("extra", [{"skip_special_tokens": True}, {"spaces_between_special_tokens": True},
                                   {"spaces_between_special_tokens": False},
                                   {"skip_special_tokens": True, "spaces_between_special_tokens": False}])
def test_the_decoding_extras_the_worker_honours_are_taken(chat_http, path, extra):
    for stream in (False, True):
        r = chat_http.post(path, json={"model": "m", "max_tokens": 2, "stream": stream, **ROUTES[path], **extra})
        assert r.status_code == 200, r.text
    assert len(chat_http.scripted.submitted) == 2


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize("field, value, status", [
    ("skip_special_tokens", False, 501), ("skip_special_tokens", "yes", 400),
    ("spaces_between_special_tokens", 1, 400),
    ("return_token_ids", True, 400), ("truncate_prompt_tokens", 8, 400), ("cache_salt", "tenant-a", 400),
])
def test_the_extras_it_cannot_honour_are_refused_naming_them(chat_http, path, field, value, status):
    e = error_of(chat_http.post(path, json={"model": "m", "max_tokens": 2, **ROUTES[path], field: value}), status)
    assert e["param"] == field and field in e["message"], e
    assert not chat_http.scripted.submitted
