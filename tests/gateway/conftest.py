"""Fixtures shared by the tests in tests/gateway/ (helpers shared across folders live in tests/support/)."""

import pytest


@pytest.fixture(scope="module")
def text_model(tiny_text_dir) -> str:
    """The tiny text model, served by its folder's name (the ``model`` of HTTP requests)."""
    return tiny_text_dir


@pytest.fixture(scope="module")
def oai(cluster):
    """The official ``openai`` SDK pointed at the module's ``cluster`` gateway (no retries)."""
    import openai

    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
