"""A slotserve process's logging, set up once: every record to stderr once, in the process's format.

:func:`configure_logging` is ``logging.basicConfig`` plus one fix. huggingface_hub gives its
library logger a ``StreamHandler`` of its own when it is first imported and leaves the logger
propagating, so once the root logger has a handler each of its records is printed twice: bare by
its handler, then in slotserve's format by the root's (a newcomer saw each of 12 retry warnings
twice). Its own advice (``huggingface_hub.utils.logging.enable_propagation``): remove its handler
where the root logger is configured. So it is imported here (~10 ms, no network, no torch) and its
handlers removed: its records then reach stderr once, through the root handler, at the level
huggingface_hub sets (WARNING unless ``HF_HUB_VERBOSITY`` says otherwise). transformers' logger has
a handler too but does not propagate (printed once, ``[transformers] ...``); importing it costs ~1 s,
so it is left as it is.
"""

from __future__ import annotations

import importlib.util
import logging


def configure_logging(level: str, fmt: str) -> None:
    """``logging.basicConfig(level=level, format=fmt)`` (a no-op where the root logger has a handler
    already), then huggingface_hub's logger (where it is installed) without handlers of its own, so
    that its records print once, in ``fmt`` (see the module docstring)."""
    logging.basicConfig(level=level, format=fmt)
    if importlib.util.find_spec("huggingface_hub") is None:
        return
    importlib.import_module("huggingface_hub.utils.logging")  # (it adds its handler on import: done before removing)
    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        hub.removeHandler(handler)
    hub.propagate = True
