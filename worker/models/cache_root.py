"""slotserve's cache folder, defined once: where assembled GGUF files and extracted model folders
(``models/``, :mod:`worker.models.parts`, :mod:`worker.models.zipped`), compiled kernels
(``kernels/``, :mod:`worker.models.llama.extension`) and the benchmarks' references (``bench/``)
are kept.

The XDG Base Directory specification's cache home: ``$XDG_CACHE_HOME`` when it is set to an
absolute path, else ``~/.cache`` (the spec: a relative or empty value is ignored, as if unset).
Read at each call, so a process that sets the variable before its first load is obeyed.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``<cache home>/slotserve`` (see the module docstring); nothing is created."""
    home = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(home) if os.path.isabs(home) else Path.home() / ".cache") / "slotserve"


def models_cache() -> Path:
    """Where assembled GGUF files and extracted model folders are kept: ``<cache root>/models``."""
    return cache_root() / "models"
