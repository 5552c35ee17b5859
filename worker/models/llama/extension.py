"""The model runner's compiled kernels (``qkernel.cpp``, ``attnkernel.cpp``): built once per machine
with torch's C++ extension builder, cached, and imported directly afterwards.

:func:`build` compiles a source the first time a process needs it (20 s to minutes on a busy
2-core machine) into ``~/.cache/slotserve/kernels/<key>`` (``$XDG_CACHE_HOME`` if set), keyed by
the source, torch's version and the flags, so a changed kernel or another torch builds anew and
later processes import the ``.so`` in milliseconds, without ninja. A build under way (torch's
builder holds ``<key>/lock``, and the ``.so`` may be half written) is waited for through the
builder rather than imported. Where it cannot run -- the CPU lacks the instructions, no C++
compiler, or ``SLOTSERVE_NO_KERNELS`` is set -- it returns None and the caller takes its pure-torch
path.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cpu_has(flag: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists ``flag`` (e.g. ``avx512_bf16``; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return False


def build(prefix: str, source: Path, flags: list[str], needs: str, fallback: str):
    """The compiled module of ``source`` (named ``slotserve_<prefix>_<key>``), or None where it cannot
    run here: the CPU lacks ``needs`` (a ``/proc/cpuinfo`` flag), ``SLOTSERVE_NO_KERNELS`` is set, or
    the build fails (logged once as a warning ending in ``fallback``, what runs instead)."""
    if os.environ.get("SLOTSERVE_NO_KERNELS") or not cpu_has(needs):
        return None
    key = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotserve" / "kernels" / key
    name = f"slotserve_{prefix}_{key}"
    built = folder / f"{name}.so"
    if built.exists() and not (folder / "lock").exists():
        try:
            spec = importlib.util.spec_from_loader(name, importlib.machinery.ExtensionFileLoader(name, str(built)))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except ImportError:  # unreadable or foreign: the builder below rebuilds it
            pass
    from torch.utils import cpp_extension  # here, not above: it imports setuptools (~0.15 s of a load)

    folder.mkdir(parents=True, exist_ok=True)
    # (a warning, so that it shows at the default log level: a first start is otherwise silent for a minute)
    log.warning("compiling %s for this machine: once per machine and torch version, about a minute on 2 cores "
                "(cached in %s)", source.name, folder.parent)
    try:
        return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  build_directory=str(folder), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or it failed
        log.warning("%s not built (%s); %s", source.name, str(exc).splitlines()[0] if str(exc) else
                    type(exc).__name__, fallback)
        return None
