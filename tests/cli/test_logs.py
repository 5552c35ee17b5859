"""slotserve/logs.py: a library's log record reaches stderr once, in the process's format. A newcomer
saw each of huggingface_hub's retry warnings twice (bare from its own handler, then in slotserve's
format from the root's). Each case runs in a fresh interpreter: logging is process-wide."""

from __future__ import annotations

import subprocess
import sys

SETUP = {
    "basicConfig": "import logging; logging.basicConfig(level='WARNING', format='FMT %(name)s %(message)s')",
    "configure_logging": "from slotserve.logs import configure_logging; "
                         "configure_logging('WARNING', 'FMT %(name)s %(message)s')",
}
WARN = ("from huggingface_hub.utils import logging as hub; "
        "hub.get_logger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')")


def stderr_lines(setup: str, after: str = "") -> list[str]:
    code = f"{SETUP[setup]}; {WARN}; {after}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.splitlines()


def test_basic_config_alone_prints_huggingface_hubs_warnings_twice():
    """The cause, kept as a test: if huggingface_hub stops doing this, the fix can go."""
    assert stderr_lines("basicConfig") == ["Retrying in 1s [Retry 1/5].",
                                           "FMT huggingface_hub.utils._http Retrying in 1s [Retry 1/5]."]


def test_configured_logging_prints_them_once_in_the_process_format():
    assert stderr_lines("configure_logging") == ["FMT huggingface_hub.utils._http Retrying in 1s [Retry 1/5]."]


def test_a_later_import_of_transformers_adds_no_second_copy():
    """transformers imports huggingface_hub's modules too (a model's load does): still one line each."""
    lines = stderr_lines("configure_logging", f"import transformers.utils.hub; {WARN}")
    assert lines == ["FMT huggingface_hub.utils._http Retrying in 1s [Retry 1/5]."] * 2
