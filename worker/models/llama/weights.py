"""The runner's weights: slotserve's fused layout, built from a :class:`~worker.models.llama.source.LlamaSource`.

:class:`LlamaWeights` copies a source (a transformers causal LM of any family
in :mod:`worker.models.llama.family`, or a GGUF file read without one) into
slotserve's own tensors, one small function per part (a family's ``(1 + w)``
norms, stored-fused projections, q/k norms and sandwich norms taken here, once):

- the sizes (:meth:`LlamaShape.of`) and, on CPU, the GEMM library the
  fp32/bf16 linears use (:func:`cpu_kind`, measured for the layer shapes);
- per layer (:func:`layer_weights`), q/k/v fused into one
  ``[(H + 2 Hkv) D, hidden]`` linear and gate/up into one ``[2 F, hidden]``
  (:func:`fused_linear`), each a linear of the chosen precision
  (:mod:`worker.models.llama.linear`), and the two norms;
- the embedding and the LM head (:func:`embedding_and_head`: one table for
  both when tied and dense), and the screened head for exact fp32 greedy
  picks (:func:`greedy_head`);
- the step's scalars (:meth:`StepConsts.of`) and the RoPE cos/sin tables for
  every position (:func:`rope_tables`), computed with transformers' own
  formula (``position * inv_freq``, concatenated twice, times the attention
  scaling), so any RoPE type with a fixed ``inv_freq`` (default, linear,
  llama3, yarn) is reproduced exactly.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models.llama import attnkernel
from worker.models.llama.family import FUSED, Family, describe
from worker.models.llama.linear import ConcatLinear, DenseLinear, cpu_linear_kind, make_linear
from worker.models.llama.quantized import QuantizedEmbedding, QuantizedWeight
from worker.models.llama.screen import ScreenedHead, screened_head
from worker.models.llama.source import LlamaSource


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """Sizes of a Llama model (names as in transformers' ``LlamaConfig``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    context: int

    @classmethod
    def of(cls, cfg, context: int) -> LlamaShape:
        """The sizes in ``cfg`` (``LlamaConfig``'s attribute names), with ``context`` tokens per slot."""
        heads = cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   ffn=cfg.intermediate_size, vocab=cfg.vocab_size, eps=float(cfg.rms_norm_eps), context=context)

    @property
    def linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """``(out, in)`` of a layer's four linears: qkv, o, gate-up, down."""
        d = self.head_dim
        return (((self.heads + 2 * self.kv_heads) * d, self.hidden), (self.hidden, self.heads * d),
                (2 * self.ffn, self.hidden), (self.hidden, self.ffn))


class LayerWeights:
    """One decoder layer: ``ln1``, ``qkv``, ``o``, ``ln2``, ``gate_up``, ``down`` (see :func:`layer_weights`);
    where the family has them (else None): ``q_norm``, ``k_norm`` ``[head_dim]`` (per-head RMSNorm
    of q and k before RoPE) and ``post_attn``, ``post_mlp`` ``[hidden]`` (norms of the attention's
    and the MLP's outputs before the residual add: Gemma's sandwich)."""

    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down", "q_norm", "k_norm", "post_attn", "post_mlp")

    def __init__(self, ln1, qkv, o, ln2, gate_up, down, q_norm=None, k_norm=None, post_attn=None,
                 post_mlp=None) -> None:
        self.ln1, self.qkv, self.o, self.ln2, self.gate_up, self.down = ln1, qkv, o, ln2, gate_up, down
        self.q_norm, self.k_norm, self.post_attn, self.post_mlp = q_norm, k_norm, post_attn, post_mlp


class Embedding:
    """Token embedding rows, returned in the activation dtype.

    Stored as int8 with one fp32 scale per 32 columns (``max|x| / 127`` of
    the block) for the int precisions, and at fp32 on CPU when that gives
    every value back bit for bit (a table that already was 8-bit with
    32-column blocks: llama.cpp's Q8_0, as in the SmolLM2 GGUF; checked over
    the whole table at load): a quarter of the bytes (SmolLM2: 113 MB -> 31
    MB). Otherwise fp32 (bf16 at bf16).
    """

    CHUNK_ROWS = 4096  # rows quantised at a time: the load's temporaries stay small

    def __init__(self, table: torch.Tensor, dtype: torch.dtype, device: str, act_dtype: torch.dtype,
                 *, exact_int8: bool = True) -> None:
        """``exact_int8=False`` keeps an fp32 table fp32 (when it is shared with a tied LM head)."""
        self.act_dtype = act_dtype
        self.scales = None
        self.exact = False  # True: rows come back as the fp32 table's, bit for bit
        rows, cols = table.shape
        exact_only = exact_int8 and dtype == torch.float32 and torch.device(device).type == "cpu"
        if (dtype == torch.int8 or exact_only) and cols % 32 == 0:
            codes = torch.empty(rows, cols // 32, 32, dtype=torch.int8)
            scales = torch.empty(rows, cols // 32, 1)
            for start in range(0, rows, self.CHUNK_ROWS):
                blocks = table[start:start + self.CHUNK_ROWS].float().reshape(-1, cols // 32, 32)
                scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_(min=1e-30)
                code = torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8)
                if exact_only and not torch.equal((code.float() * scale).view(torch.int32), blocks.view(torch.int32)):
                    # compared as bits: -0.0 must not come back as +0.0
                    break
                codes[start:start + len(blocks)], scales[start:start + len(blocks)] = code, scale
            else:
                self.scales, self.table = scales.to(device), codes.reshape(rows, cols).to(device)
                self.exact = exact_only
                return
        # own memory (copy=True): the HF tensor may map the whole weights file
        self.table = table.to(device=device, dtype=torch.float32 if dtype == torch.int8 else dtype, copy=True)
        self.exact = self.table.dtype == torch.float32 == table.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.table)
        if self.scales is not None:
            rows = (rows.float().view(len(ids), -1, 32) * self.scales[ids]).view(len(ids), -1)
        return rows.to(self.act_dtype)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size() + (0 if self.scales is None else self.scales.numel() * 4)


@dataclass(frozen=True, slots=True)
class StepConsts:
    """The step's scalars: fp32 0-dim tensors on CPU, Python floats elsewhere (see :meth:`of`)."""

    inv_hidden: torch.Tensor | float
    eps: torch.Tensor | float
    scaling: torch.Tensor | float
    eps_value: float  # for F.rms_norm on CUDA and the compiled one on CPU
    inv_head_dim: torch.Tensor | float  # of the per-head q/k norms
    inv_hidden_value: float = 0.0  # 1 / hidden as a float (the compiled RMSNorm's argument)

    @classmethod
    def of(cls, cfg, scaling: float, on_cpu: bool, head_dim: int = 1) -> StepConsts:
        """``1 / hidden``, RMSNorm's eps, the attention scaling and ``1 / head_dim``.

        On CPU as fp32 0-dim tensors: an op with a Python float converts it to
        a tensor on every call (2-3 us each, 5 per layer; measured), same value
        and result (the activations are fp32 there). On CUDA they stay floats:
        a bf16 op would round a 0-dim bf16 tensor (the scaling of head_dim 128
        by ~1e-4), and graph replay hides the cost.
        """
        def const(v: float):
            return torch.tensor(v, dtype=torch.float32) if on_cpu else v

        return cls(const(1.0 / cfg.hidden_size), const(float(cfg.rms_norm_eps)), const(scaling),
                   eps_value=float(cfg.rms_norm_eps), inv_head_dim=const(1.0 / head_dim),
                   inv_hidden_value=1.0 / cfg.hidden_size)


class LlamaWeights:
    """The model's tensors in slotserve's layout (see module docstring).

    Attributes: ``shape`` (:class:`LlamaShape`), ``precision``, ``device``,
    ``act_dtype``, ``linear_kind`` (the layers' linear kind: dense, mkl or
    onednn at fp32/bf16, int8/int4; logged by the worker), ``layers``
    (:class:`LayerWeights`), ``norm``, ``embed`` (:class:`Embedding`),
    ``head``, ``greedy_head`` (a :class:`~worker.models.llama.screen.ScreenedHead`
    or None), ``scaling``, ``consts`` (:class:`StepConsts`), ``cos`` and
    ``sin_signed`` (:func:`rope_tables`); the family's data
    (:class:`~worker.models.llama.family.Family`): ``family``, ``local_rope``
    (``(cos, sin_signed)`` of the sliding layers' own RoPE, or None),
    ``embed_scale`` (0-dim, or None) and ``act`` (the gated MLP's activation); ``attention_kernel``
    (the compiled decode attention of :mod:`~worker.models.llama.attnkernel`, or None: batched products).
    """

    def __init__(self, source: LlamaSource, precision: str, device: str, max_len: int,
                 cpu_linear: str = "auto", screen_head: bool | None = None, family: Family | None = None) -> None:
        """Copy ``source``'s tensors (:class:`~worker.models.llama.source.LlamaSource`) into this layout;
        fp32/bf16 linears on CPU of kind ``cpu_linear`` (``auto``: measured, see
        :func:`~worker.models.llama.linear.cpu_linear_kind`). ``screen_head`` (fp32 on CPU, tied
        head): greedy rows pick through :class:`~worker.models.llama.screen.ScreenedHead`; None:
        when its bf16 product measures faster than the fp32 head (:func:`screened_head`).
        ``family``: the model's :class:`~worker.models.llama.family.Family` (default: described
        from ``source.config``). At precision ``gguf`` each of ``source.layers`` is emptied once
        copied (fused q/k/v and gate/up are new tensors; their stored parts would otherwise stay
        until the load ends: Qwen2.5-0.5B's peak RSS +240 MiB, measured). Raises :class:`~worker.models.llama.family.Unsupported` for a
        config the runner does not implement, ValueError for a kind this torch cannot run, or ``screen_head=True`` where
        oneDNN has no bf16 product."""
        self.family = fam = family or describe(source.config, max_len)
        self.shape = shape = LlamaShape.of(source.config, max_len)
        self.precision, self.device = precision, device
        self.act_dtype = act = torch.bfloat16 if precision == "bf16" and device != "cpu" else torch.float32
        on_cpu = torch.device(device).type == "cpu"
        layer_kind = cpu_kind(precision, shape, device, cpu_linear) if precision in ("fp32", "bf16") else None
        self.linear_kind = layer_kind or (precision if on_cpu else "dense")
        if precision == "gguf":  # what runs: the file's formats, e.g. "Q4_K x 168, Q6_K x 29"
            self.linear_kind = stored_formats(source)
        self.layers = []
        for i, layer in enumerate(source.layers):
            self.layers.append(layer_weights(layer, precision, device, layer_kind, act, fam.norm_offset))
            if precision == "gguf":  # the stored parts of a fused weight go now, not after the whole load
                source.layers[i] = {}
                lw = self.layers[-1]
                for linear in (lw.qkv, lw.o, lw.gate_up, lw.down):
                    prepare_stored(linear)
        self.norm = _norm_copy(source.norm, device, act, fam.norm_offset)
        head_source = source.embed if source.head is None else source.head
        head_kind = None if isinstance(head_source, QuantizedWeight) else cpu_kind(  # at fp32/bf16: layer_kind's
            _head_precision(precision), shape, device, cpu_linear)
        self.embed, self.head = embedding_and_head(source, self.layers[0].qkv, precision, device, act, head_kind)
        if precision == "gguf":
            prepare_stored(self.head)
            self.set_gguf_activations("auto")
        self.greedy_head = greedy_head(source, self.embed, self.head, precision, on_cpu, screen_head)
        self.scaling = fam.scaling
        self.consts = StepConsts.of(source.config, self.scaling, on_cpu, shape.head_dim)
        self.cos, self.sin_signed = rope_tables(source.inv_freq, source.attention_scaling, max_len,
                                                shape.head_dim, device, act)
        # Gemma 3's sliding layers: their own RoPE base; None where every layer uses the one above
        self.local_rope = None if source.local_rope is None else rope_tables(
            *source.local_rope, max_len, shape.head_dim, device, act)
        # the embedding's factor (Gemma), in the dtype transformers multiplies by: the weights' own
        self.embed_scale = None if fam.embed_scale is None else torch.tensor(
            fam.embed_scale, dtype=torch.bfloat16 if precision == "bf16" else torch.float32).to(device, act)
        self.act = F.silu if fam.activation == "silu" else functools.partial(F.gelu, approximate="tanh")
        # the compiled decode attention (worker.models.llama.attnkernel; built here, not at the first step),
        # or None: batched products. The forward uses it where it runs the cache (attnkernel.runs).
        self.attention_kernel = attnkernel.load() if on_cpu and act == torch.float32 else None

    def set_gguf_activations(self, activations: str) -> None:
        """At precision ``gguf``: how every compiled product meets the stored codes
        (``ModelOptions.gguf_activations``; :meth:`~worker.models.llama.qkernel.Kernel.set_activations`),
        said in :attr:`linear_kind`. ``"auto"``: int8 where it runs, the LM head as
        :data:`HEAD_ACTIVATIONS` says. ValueError as that method (``"int8"`` where it does not run)."""
        from worker.models.llama import qkernel

        kernels = [w.kernel for w in self.stored_weights() if w.kernel is not None]
        if activations != "auto" and not kernels:
            raise ValueError(f"gguf_activations={activations!r} needs the compiled kernel, which does not run here "
                             "(the stored weights multiply in pure torch)")
        head = {id(w.kernel) for w in getattr(self.head, "parts", (self.head,)) if getattr(w, "kernel", None)}
        for k in kernels:
            k.set_activations(HEAD_ACTIVATIONS if activations == "auto" and id(k) in head else activations)
        # a 6-bit span that six_bits() held a byte each (MAGIC where 6 bits would be SIX)
        bytes_six = any(w.kernel is not None and qkernel.kind(w) != qkernel.code_kind(
            w.nibbles, w.low, w.high, w.in_features, w.group, True) for w in self.stored_weights())
        head_bf16 = any(id(k) in head and not k.int8 for k in kernels) and any(k.int8 for k in kernels)
        self.linear_kind = self.linear_kind.split(" (")[0] + stored_product(
            sum(k.int8 for k in kernels), len(kernels), any(k.tiles for k in kernels), bytes_six, head_bf16)

    def stored_weights(self) -> list:
        """The QuantizedWeights this model multiplies (layers' parts and the head), each once."""
        out, seen = [], set()
        for linear in [w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [self.head]:
            for w in getattr(linear, "parts", (linear,)):
                if isinstance(w, QuantizedWeight) and id(w) not in seen:
                    seen.add(id(w))
                    out.append(w)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of weights (tables included)."""
        linears = [w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        table = getattr(self.embed, "table", getattr(self.embed, "weight", None))
        head = 0 if self.head is table or getattr(self.head, "weight", None) is table else self.head.nbytes
        screen = 0 if self.greedy_head is None else self.greedy_head.screen.nbytes
        return sum(x.nbytes for x in linears) + self.embed.nbytes + head + screen


def cpu_kind(precision: str, shape: LlamaShape, device: str, cpu_linear: str) -> str | None:
    """The CPU linear kind for ``precision`` (``"bf16"``, else fp32) weights of ``shape``'s layers:
    ``cpu_linear``, or with ``"auto"`` oneDNN's where torch has it, else the GEMM library measured
    fastest for those shapes on this CPU (:func:`~worker.models.llama.linear.cpu_linear_kind`, once
    per process); None off the CPU.
    Raises ValueError for a kind this torch cannot run."""
    if torch.device(device).type != "cpu":
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return cpu_linear_kind(dtype, shape.linear_shapes, None if cpu_linear == "auto" else cpu_linear)


def layer_weights(layer: dict, precision: str, device: str, kind: str | None, act: torch.dtype,
                  norm_offset: float = 0.0) -> LayerWeights:
    """One decoder layer of a :class:`~worker.models.llama.source.LlamaSource`: fused linears, copied
    norms (each applied as ``norm_offset + w``: Gemma's ``(1 + w)``, added once here)."""
    def fused(*keys: str):
        return fused_linear(layer, keys, precision, device, kind)

    def norm(key: str):
        return None if key not in layer else _norm_copy(layer[key], device, act, norm_offset)

    qkv, gate_up = FUSED
    return LayerWeights(norm("ln1"), fused(*qkv), fused("o"), norm("ln2"), fused(*gate_up), fused("down"), norm("q_norm"), norm("k_norm"), norm("post_attn"), norm("post_mlp"))


def fused_linear(layer: dict, keys: tuple[str, ...], precision: str, device: str, kind: str | None):
    """One linear over ``layer``'s weights ``keys`` stacked along the output (q, k, v -> qkv), biases
    alike; a source that stores them fused already (Phi-3's ``"qkv"``, ``"gate_up"``) gives it as is.
    At precision ``gguf``, parts stored quantised: :func:`stored_fused`."""
    stored = "".join(keys) if len(keys) == 3 else "_".join(keys)  # "qkv", "gate_up"
    if len(keys) > 1 and stored in layer:
        return make_linear(layer[stored], layer.get(stored + ".bias"), precision, device, kind)
    if any(isinstance(layer[k], QuantizedWeight) for k in keys):
        if precision == "gguf":
            return stored_fused([make_linear(layer[k], layer.get(k + ".bias"), precision, device, kind)
                                 for k in keys])
        layer = {k: v.dequantize() if isinstance(v, QuantizedWeight) else v for k, v in layer.items()}
    weight = torch.cat([layer[k] for k in keys])
    bias = None if keys[0] + ".bias" not in layer else torch.cat([layer[k + ".bias"] for k in keys])
    return make_linear(weight, bias, precision, device, kind)


def stored_fused(parts: list):
    """Linears of one input fused (precision ``gguf``): one
    :class:`~worker.models.llama.quantized.QuantizedWeight` of their rows (``QuantizedWeight.cat``)
    where one can hold them all (``stacks_with``: one format, or formats with the same factors, as
    Qwen2.5-Coder-0.5B's Q5_0 q and k beside a Q8_0 v), else a
    :class:`~worker.models.llama.linear.ConcatLinear` of the runs of consecutive parts that one can
    hold (a Q4_K_M file's Q4_K q and k as one, beside a Q6_K v). One product a run: a call's fixed
    cost (~10 us, the Python and the threads' start included) is a share of a small product's."""
    if len(parts) == 1:
        return parts[0]
    runs: list[list] = []
    for p in parts:
        last = runs[-1][-1] if runs else None
        if isinstance(p, QuantizedWeight) and isinstance(last, QuantizedWeight) and last.stacks_with(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    fused = [run[0] if len(run) == 1 else QuantizedWeight.cat(run) for run in runs]
    return fused[0] if len(fused) == 1 else ConcatLinear(fused)


HEAD_ACTIVATIONS = "auto"
"""The LM head's activations under ``gguf_activations="auto"``: ``"auto"``, as the layers' (int8 where it
runs, as llama.cpp's Q8 activations), since a prompt's attention is its decode's and greedy answers no
longer follow the serving timing. HE32, greedy answers identical to fp32 (2-core Zen 4, the same in
every run), bf16 head -> int8 head: SmolLM2 17 -> 16, Qwen2.5-Coder-0.5B 28 -> 27, -1.5B 30 -> 29
(llama.cpp's server 15, 23, 20 in that run; 14-15, 24-26 and 17-20 in earlier ones); decode steps at 8
slots, in turns in one process: SmolLM2 17.6 -> 16.8 ms, the 0.5B 34.6 -> 30.3, the 1.5B 75.8 -> 70.1
(the head is the largest product of a step: the 0.5B's 151,936 x 896). ``"bf16"`` here puts the head
alone on bf16 activations: the bf16 head's answers and step times above."""


def prepare_stored(linear) -> None:
    """Hand a gguf linear's stored weights (a QuantizedWeight, or a ConcatLinear's) to the compiled
    kernel where one runs here (``QuantizedWeight.prepare``: in place, after any fusing)."""
    for w in getattr(linear, "parts", (linear,)):
        if isinstance(w, QuantizedWeight):
            w.prepare()


def stored_product(int8: int = 0, kernels: int = 0, tiles: bool = False, bytes_six: bool = False,
                   head_bf16: bool = False) -> str:
    """What multiplies the stored weights here, for :attr:`LlamaWeights.linear_kind`: ``int8`` of the
    ``kernels`` compiled products with int8 activations, ``tiles`` prefill chunks on bf16 tiles
    (:meth:`LlamaWeights.set_gguf_activations`), ``bytes_six`` 6-bit codes held a byte each
    (:func:`~worker.models.llama.qkernel.six_bits`), ``head_bf16`` the LM head alone on bf16
    activations (``auto``'s choice)."""
    from worker.models.llama import qkernel

    module = qkernel.load()
    if module is None:
        return " (pure torch: fp32 on the dequantised weights)"
    amx = module.has_amx()
    bf16 = "AMX-BF16" if amx else "AVX-512 BF16"
    extra = ("; prefill chunks on bf16 tiles" if tiles else "") + ("; 6-bit codes a byte each" if bytes_six else "")
    if not int8:
        return f" (compiled kernel, bf16 activations, {bf16}{extra})"
    int8_kind = "VNNI + AMX-INT8" if amx else "AVX2" if qkernel.isa() == "avx2" else "VNNI"
    if int8 == kernels:
        return f" (compiled kernel, int8 activations, {int8_kind}{extra})"
    if head_bf16 and int8 == kernels - 1:
        return f" (compiled kernel, int8 activations, {int8_kind}; the LM head's bf16, {bf16}{extra})"
    return f" (compiled kernel, int8 activations, {int8_kind}; bf16 on {kernels - int8} of {kernels}, {bf16}{extra})"


def stored_formats(source: LlamaSource) -> str:
    """The source's weight matrices by stored format, most first: ``"Q4_K x 168, Q6_K x 29"``
    (``fp32`` for the ones read as tensors); what precision ``gguf`` runs, for the worker's log."""
    tensors = [t for layer in source.layers for key, t in layer.items()
               if isinstance(t, QuantizedWeight) or (t.dim() == 2 and "." not in key)]
    tensors += [t for t in (source.embed, source.head) if t is not None]
    counts = Counter(t.fmt if isinstance(t, QuantizedWeight) else "fp32" for t in tensors)
    return ", ".join(f"{fmt} x {n}" for fmt, n in counts.most_common())


def embedding_and_head(source: LlamaSource, qkv, precision: str, device: str, act: torch.dtype,
                       head_kind: str | None) -> tuple[Embedding, object]:
    """``(embedding, LM head)``.

    The LM head stays fp32 at int8/int4 (bf16 at bf16; linear kind
    ``head_kind`` on CPU) and the embedding is int8 in 32-column blocks:
    quantising the head per row (and the embedding) cost most of the greedy
    agreement with fp32 on HumanEval prompts (measured: 1 of 8 identical
    against 6 of 8 with int4 layers). A tied head over dense layers
    (``qkv``, the first layer's, is a :class:`DenseLinear`) of the
    embedding's dtype uses the embedding's table: one tensor for both, as in
    the HF model.

    At precision ``gguf`` a quantised embedding is read from its stored rows
    (:class:`~worker.models.llama.quantized.QuantizedEmbedding`) and a tied head is that same
    stored weight; an untied head runs as stored.
    """
    if precision == "gguf" and isinstance(source.embed, QuantizedWeight):
        head = source.embed if source.head is None else source.head
        return QuantizedEmbedding(source.embed, act), make_linear(head, None, precision, device, head_kind)
    table = source.embed.dequantize() if isinstance(source.embed, QuantizedWeight) else source.embed
    embed_dtype = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.int8}.get(precision, act)
    share = source.head is None and isinstance(qkv, DenseLinear)  # the head can use the embedding's table
    embed = Embedding(table, embed_dtype, device, act, exact_int8=not share)
    if share and embed.table.dtype == qkv.weight.dtype:
        return embed, DenseLinear(embed.table)
    return embed, make_linear(table if source.head is None else source.head, None,
                              _head_precision(precision), device, head_kind)


def greedy_head(source: LlamaSource, embed: Embedding, head, precision: str, on_cpu: bool,
                use: bool | None) -> ScreenedHead | None:
    """The screened head for greedy rows (:mod:`worker.models.llama.screen`), or None.

    Only fp32 on CPU with the head tied to an embedding stored exactly (the
    screen's candidates read their rows there), and when ``use`` says so
    (None: when its bf16 product measures faster here, :func:`screened_head`).
    Raises ValueError for ``use=True`` anywhere else.
    """
    if on_cpu and precision == "fp32" and source.head is None and embed.exact:
        table = source.embed.dequantize() if isinstance(source.embed, QuantizedWeight) else source.embed.float()
        return screened_head(table, head, embed, use)
    if use:
        raise ValueError("screen_head needs fp32 on CPU and an LM head tied to an exactly stored embedding")
    return None


def rope_tables(inv_freq: torch.Tensor, attention_scaling: float, max_len: int, head_dim: int, device: str,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin_signed)``, each ``[max_len, head_dim]``: RoPE's tables at every position, for
    ``inv_freq`` ``[head_dim / 2]`` and ``attention_scaling`` (a source's, transformers' values).

    transformers' formula: ``emb = cat(position * inv_freq, twice)``, ``cos``
    and ``sin`` of it times the attention scaling; ``sin`` with its second
    half negated (``rotate_half(x) * sin``, crosswise: see
    :func:`worker.models.llama.model._rope_`), exactly.
    """
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float().cpu()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)
    sin = emb.sin() * attention_scaling
    sin[:, head_dim // 2:].neg_()
    return cos, sin.to(device=device, dtype=dtype)


def _head_precision(precision: str) -> str:
    """The LM head's precision: bf16 at bf16, as stored at gguf, else fp32 (see :func:`embedding_and_head`)."""
    return precision if precision in ("bf16", "gguf") else "fp32"


def _norm_copy(weight: torch.Tensor, device: str, dtype: torch.dtype, offset: float) -> torch.Tensor:
    """An RMSNorm weight as applied, ``offset + w`` (computed in fp32, as Gemma's norm does), own memory."""
    return _own_copy(weight if offset == 0.0 else weight.float() + offset, device, dtype)


def _own_copy(weight: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``weight`` of its own: the source may map the whole weights file."""
    return weight.to(device=device, dtype=dtype, copy=True)
