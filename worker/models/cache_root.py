"""slotserve's cache folder, defined once: where assembled GGUF files and extracted model folders
(``models/``, :mod:`worker.models.parts`, :mod:`worker.models.zipped`), compiled kernels
(``kernels/``, :mod:`worker.models.llama.extension`) and the benchmarks' references (``bench/``)
are kept.

The XDG Base Directory specification's cache home: ``$XDG_CACHE_HOME`` when it is set to an
absolute path, else ``~/.cache`` (the spec: a relative or empty value is ignored, as if unset).
Read at each call, so a process that sets the variable before its first load is obeyed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def cache_root() -> Path:
    """``<cache home>/slotserve`` (see the module docstring); nothing is created.

    Raises FileNotFoundError (an OSError, as a cache folder that cannot be made: the optional caches
    pass it by) where ``XDG_CACHE_HOME`` is no absolute path and no home folder can be found (HOME
    unset and a uid with no passwd entry: a container run as an arbitrary uid with a cleared
    environment), naming the variables to set; pathlib's own RuntimeError ('Could not determine home
    directory') failed a model's load even where its cache is optional (the compiled kernels)."""
    home = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(home):
        return Path(home) / "slotserve"
    try:
        return Path.home() / ".cache" / "slotserve"
    except RuntimeError:
        raise FileNotFoundError(errno.ENOENT, "no cache folder for slotserve: XDG_CACHE_HOME is not an absolute path "
                                "and no home folder can be found (HOME is unset and this uid has no passwd "
                                "entry); set XDG_CACHE_HOME or HOME") from None


def models_cache() -> Path:
    """Where assembled GGUF files and extracted model folders are kept: ``<cache root>/models``."""
    return cache_root() / "models"
