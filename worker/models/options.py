"""How a real model is run: device, precision, runner, prefill chunk, threads.

One frozen, validated dataclass (:class:`ModelOptions`) travels from the CLI
(``--device``, ``--precision``, ``--runner``, ``--max-prefill-tokens``,
``--speculative-tokens``, ``--threads``, ``--kv-cache-dtype``, ``--max-model-len``) through :class:`worker.process.WorkerConfig` to
:func:`worker.models.load_model`. Importing this module does not import
torch; :meth:`ModelOptions.resolve` does, to see whether CUDA is there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from protocol.validation import echo

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "int8", "int4", "gguf")
RUNNERS = ("auto", "slotserve", "hf")
CPU_LINEARS = ("auto", "dense", "mkl", "onednn")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16")
GGUF_ACTIVATIONS = ("auto", "int8", "bf16")
POOLING_MODES = ("last", "mean", "cls")
"""``--pooling``: the modes of :data:`worker.models.pooling.MODES`, the decoders' usual one first."""
"""``--kv-cache-dtype`` (vLLM's flag name): the KV cache's element type; auto is the activations'."""

DEFAULT_MAX_PREFILL_TOKENS = 512
"""Prompt tokens per iteration: a longer prompt is prefilled in chunks of this size,
so the other slots' decode steps wait at most one chunk (vLLM's and SGLang's chunked prefill)."""

DEFAULT_MAX_MODEL_LEN = 8192
"""Tokens per slot (prompt + ``max_tokens``) when ``--max-model-len`` is not given: the model's
context, at most this many (Ollama's choice of a fixed default below the trained context, not
llama.cpp's context split across slots, so a request's limit does not change with ``--slots``).
8192 is SmolLM2's whole context, so it serves as before, while a 32k or 128k model reserves 8k
per slot (CPU: address space, backed as written; CUDA keeps its 4096, allocated whole)."""

MAX_SPECULATIVE_TOKENS = 16
"""Most draft tokens per request and iteration (each costs a row of every linear)."""

MAX_THREADS = 1024
"""The most CPU threads (``num_threads``, ``--threads``) a worker's model may be given: more than the
largest machines' hardware threads (two 192-core CPUs with SMT: 768), and well below the counts
at which torch's OpenMP runtime cannot create its threads (measured with torch 2.x on Linux: 4,096
ran, 16,384 ended in libgomp's "Thread creation failed", 100,000 in a segmentation fault of the worker)."""


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Options for loading a real model (ignored by ``simulated``, which refuses non-defaults).

    - ``device``: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when torch sees a GPU).
    - ``precision``: ``"fp32"`` (exact: greedy equals transformers' ``generate``),
      ``"bf16"``, ``"int8"`` / ``"int4"`` (weight-only, torch's own kernels),
      ``"gguf"`` (a GGUF file's weights as it stores them: its block formats'
      codes and scales, :mod:`worker.models.llama.quantized`; CPU only), or
      ``"auto"``: on CPU ``gguf`` for a GGUF file with block-quantised weights
      (decided at load, :func:`worker.models.load_model`) and fp32 otherwise;
      bf16 on CUDA. int8/int4/gguf need the slotserve runner.
    - ``runner``: ``"slotserve"`` (its own decoder runner: Llama, Mistral,
      Qwen2/2.5, Qwen3, Gemma 2/3 and Phi-3, :mod:`worker.models.llama.family`),
      ``"hf"`` (the transformers forward: any architecture, the numerical
      reference) or ``"auto"`` (slotserve where it runs the model's config
      exactly, hf otherwise: another architecture, or a feature the runner
      refuses at load, such as a dynamic RoPE).
    - ``max_prefill_tokens``: prompt tokens per iteration (int >= 16).
    - ``speculative_tokens``: speculative decoding with prompt-lookup drafts
      (:mod:`worker.models.llama.lookup`): up to that many draft tokens per
      greedy request and iteration, verified in the same forward, so the
      tokens are the ones decoding without drafts would give. 0 (the
      default) is off, as in vLLM and TGI. The slotserve runner on CPU only.
    - ``cpu_linear``: the GEMM library of fp32/bf16 linears on CPU (slotserve
      runner): ``"dense"`` (``F.linear``), ``"mkl"`` (MKL's packed sgemm, fp32
      only), ``"onednn"`` (oneDNN's packed layout), or ``"auto"``: ``"onednn"``
      where torch has it (its rows do not depend on the rows beside them), else
      the one measured fastest on this CPU at load
      (:func:`worker.models.llama.linear.cpu_linear_kind`).
    - ``num_threads``: torch CPU threads for the process (None: torch's default).
    - ``prefix_cache_mb``: MiB of KV kept for prefix caching
      (:mod:`worker.models.llama.prefix_cache`; the slotserve runner): 0 is
      off, None (the default) sizes it from the machine (10 % of RAM on CPU,
      of free GPU memory on CUDA, at most 4 GiB).
    - ``kv_cache_dtype``: the KV cache's (and the prefix cache's) element type
      (slotserve runner): ``"fp32"``, ``"bf16"`` or ``"fp16"`` (half the bytes
      per slot; on CPU attention still computes in fp32, reading the keys and
      values upcast; fp16, llama.cpp's default cache type, keeps 3 more bits of
      each value than bf16 and holds up to 65,504), or ``"auto"`` (fp16 for precision ``gguf`` on CPU, llama.cpp's
      default for a GGUF; else the activations': fp32 on CPU, the precision's on
      CUDA, where only auto or that dtype is accepted, checked at load).
    - ``gguf_activations``: how precision ``gguf``'s compiled kernel meets the stored codes
      (:meth:`worker.models.llama.qkernel.Kernel.set_activations`): ``"int8"``, rounded to int8 per
      row and group of the weight (llama.cpp's Q8 activations; AVX-512 VNNI and VBMI, AMX-INT8 where
      there, prefill chunks over 64 rows on the weights rounded to bf16 with AMX); ``"bf16"``, the
      activations rounded to bf16 times the file's weights exactly, at every row count (slower, more
      greedy answers identical to fp32: docs/models.md); ``"auto"`` (default), int8 where it runs (the LM
      head too: ``weights.HEAD_ACTIVATIONS``), else bf16. Each way a decode row's result (up to 64 rows) is
      independent of the rows beside it, and a prompt's of its chunks (docs/architecture.md).
    - ``max_model_len``: tokens per slot (prompt + ``max_tokens``; vLLM's
      ``--max-model-len``, llama.cpp's ``-c``), int >= 2, at most the model's
      trained context (ValueError at load past it); None: the context, at most
      :data:`DEFAULT_MAX_MODEL_LEN` (4096 on CUDA; less where a longrope RoPE
      is static over fewer positions).

    - ``chat_template``: a Jinja chat template that replaces the tokenizer's (the
      template's text, or the path of a file holding it; vLLM's and llama.cpp's
      ``--chat-template``): for a model whose file has none (the Gemma 3 GGUF) or
      to change it. None: the model's own. Read and parsed at load (ValueError
      for a file that is not there and text that is no Jinja, or a syntax error).
    - ``pooling``: serve the model as an embedding model pooled so (``"last"``, ``"mean"``,
      ``"cls"``; :mod:`worker.models.embedder`): a decoder's embeddings (vLLM's ``--task embed`` with
      its pooler), or another mode for a sentence-transformers folder. None (default): a
      sentence-transformers folder (e.g. ``all-minilm-l6-v2``) embeds with its own pooling, anything
      else generates. An embedding model takes ``device``, ``precision`` (fp32 or bf16),
      ``num_threads`` and ``max_model_len`` (the longest prompt); the decoder runner's options are refused.

    Raises ValueError for a value outside these sets.
    """

    device: str = "auto"
    precision: str = "auto"
    runner: str = "auto"
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    speculative_tokens: int = 0
    cpu_linear: str = "auto"
    num_threads: int | None = None
    prefix_cache_mb: float | None = None
    kv_cache_dtype: str = "auto"
    gguf_activations: str = "auto"
    max_model_len: int | None = None
    chat_template: str | None = None
    pooling: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("device", DEVICES), ("precision", PRECISIONS), ("runner", RUNNERS),
                              ("cpu_linear", CPU_LINEARS), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("gguf_activations", GGUF_ACTIVATIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if type(self.max_prefill_tokens) is not int or self.max_prefill_tokens < 16:
            raise ValueError(f"max_prefill_tokens must be an int >= 16, got {self.max_prefill_tokens!r}")
        if type(self.speculative_tokens) is not int or not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.speculative_tokens!r}")
        if self.speculative_tokens and (self.runner == "hf" or self.device == "cuda"):
            raise ValueError("speculative decoding (speculative_tokens > 0) needs the slotserve runner on CPU")
        if self.cpu_linear != "auto" and (self.runner == "hf" or self.device == "cuda"):
            raise ValueError(f"cpu_linear={self.cpu_linear!r} needs the slotserve runner on CPU")
        if self.cpu_linear == "mkl" and self.precision == "bf16":
            raise ValueError("cpu_linear='mkl' is fp32 only (MKL's packed sgemm); bf16 runs on dense or onednn")
        if self.num_threads is not None and (type(self.num_threads) is not int
                                             or not 1 <= self.num_threads <= MAX_THREADS):
            raise ValueError(f"num_threads must be None or an int in [1, {MAX_THREADS}], got {self.num_threads!r}")
        mb = self.prefix_cache_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 <= mb < 2**40):
            raise ValueError(f"prefix_cache_mb must be None or a number of MiB >= 0 (0 = off), got {mb!r}")
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be None or an int >= 2 (tokens per slot), got {self.max_model_len!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise ValueError("chat_template must be a Jinja template's text or a file's path, not empty")
        if self.gguf_activations != "auto" and self.precision not in ("auto", "gguf"):
            raise ValueError(f"gguf_activations={self.gguf_activations!r} applies to precision gguf (a GGUF file's "
                             f"stored weights), not {self.precision}")
        if self.kv_cache_dtype != "auto" and self.runner == "hf":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs the slotserve runner (the hf runner's "
                             "cache has the weights' dtype); use kv_cache_dtype='auto'")
        if self.runner == "hf" and self.precision in ("int8", "int4", "gguf"):
            raise ValueError(f"precision {self.precision} needs the slotserve runner, not runner=hf")
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be None or one of {', '.join(POOLING_MODES)}; got {self.pooling!r}")
        if self.device == "cuda" and self.precision == "gguf":
            raise ValueError("precision gguf runs on CPU only (no CUDA kernel for the file's block formats); "
                             "on CUDA use bf16 (or auto)")

    @property
    def is_default(self) -> bool:
        return self == ModelOptions()

    def as_kwargs(self) -> dict:
        """The options as keyword arguments of :func:`worker.models.load_model`."""
        return asdict(self)

    def resolve(self) -> tuple[str, str]:
        """``(device, precision)`` with ``auto`` decided: CUDA if available (CPU for precision
        ``gguf``, which runs there only); fp32 on CPU, bf16 on CUDA (:func:`worker.models.load_model`
        then makes a CPU ``auto`` ``gguf`` for a GGUF file with block-quantised weights: only it
        sees the file).

        Raises ValueError for ``device="cuda"`` when torch sees no GPU.
        """
        import torch

        device = self.device
        if device == "auto":  # gguf runs on CPU only: there even where a GPU is
            device = "cuda" if torch.cuda.is_available() and self.precision != "gguf" else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda: torch sees no CUDA GPU (a CPU build of torch, or no driver); "
                             "use --device cpu")
        precision = self.precision
        if precision == "auto":
            precision = "bf16" if device == "cuda" else "fp32"
        return device, precision


def chat_template_text(value: str) -> str:
    """The template ``value`` (:attr:`ModelOptions.chat_template`) names: the file's text when it is
    a file's path, else ``value`` itself when it is Jinja (holds ``{{`` or ``{%``). ValueError for
    neither (a template's name, as llama.cpp's ``--chat-template chatml``, is neither: the message
    says so), or for a template Jinja cannot parse (the line and why)."""
    import os

    text = value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"chat_template: {echo(value)} is no file, and no Jinja template ({{{{ ... }}}} or "
                         "{% ... %}) either: give the template's file or its text (the names of the templates "
                         "built into llama.cpp, such as chatml or llama3, are not known here)")
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not parse (line {e.lineno}): {e.message}") from None
    return text
