"""Fixtures shared by the tests in tests/gateway/ (helpers shared across folders live in tests/support/)."""

import pytest


@pytest.fixture(scope="module")
def text_model(tiny_text_dir) -> str:
    """The tiny text model, served by its folder's name (the ``model`` of HTTP requests)."""
    return tiny_text_dir
