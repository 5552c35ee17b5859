"""Fixtures shared by the model-backend tests: the tiny random Llama (``model_dir``,
used by test_llama_runner and test_llama_speculative; test_hf_models overrides it
with its own models) and transformers' own model loaded from the module's
``model_dir`` (``reference``)."""

import pytest

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
