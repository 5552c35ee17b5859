"""Fixtures for every folder of tests/ (each folder's own are in its conftest.py;
helpers shared across folders are in tests/support/)."""

import pytest

from tests.support.tiny_text import make_tiny_text_model


@pytest.fixture(scope="module")
def tiny_text_dir(tmp_path_factory) -> str:
    """The folder of the tiny text model (a real byte-level BPE tokenizer, a tiny
    random GPT-2): :func:`tests.support.tiny_text.make_tiny_text_model`. Needs
    transformers and tokenizers."""
    return make_tiny_text_model(tmp_path_factory.mktemp("tiny-text"))
