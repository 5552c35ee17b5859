"""A default is declared once, in the code: where the docs say one (`--max-attempts` ... (default
3)), it is the option's own. The docs' words ("`--max-attempts` failed workers (default 3)", in
docs/reliability.md and again in docs/cluster.md) restated BrokerConfig's ``max_attempts = 3`` with
nothing to keep them equal; now each "`--OPTION` ... (default N" of the docs and README is read and
compared with the default of that option of the ``slotserve`` CLI (taken from the configs' fields)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from slotserve.cli import main

ROOT = Path(__file__).resolve().parents[2]

_SAID = re.compile(r"`(--[a-z0-9-]+)`[^`(]{0,60}?\(default ([0-9][0-9,]*(?:\.[0-9]+)?)(?![0-9.,]*\s*%)")
"""An option in backquotes, then within a few words ``(default N`` (a number; not a share: ``10 %``)."""


def _cli_defaults() -> dict[str, set]:
    """Every option of every ``slotserve`` command -> its defaults (one per command that has it)."""
    found: dict[str, set] = {}

    def walk(cmd: click.Command) -> None:
        for p in cmd.params:
            if isinstance(p, click.Option):
                for opt in p.opts:
                    found.setdefault(opt, set()).add(p.default)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(main)
    return found


def _docs_defaults() -> list[tuple[str, str, str]]:
    """``(file, option, default as written)`` for each default the docs and README state."""
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = " ".join(path.read_text(encoding="utf-8").split())  # (a sentence may wrap anywhere)
        out += [(path.name, m.group(1), m.group(2)) for m in _SAID.finditer(text)]
    return out


def test_every_default_the_docs_state_is_the_options_own():
    cli = _cli_defaults()
    said = _docs_defaults()
    assert ("reliability.md", "--max-attempts", "3") in said and ("cluster.md", "--max-attempts", "3") in said
    wrong = [(f, opt, n, sorted(map(str, cli.get(opt, ())))) for f, opt, n in said
             if opt not in cli or not any(d is not None and not isinstance(d, bool) and isinstance(d, (int, float))
                                          and float(n.replace(",", "")) == d for d in cli[opt])]
    assert not wrong, f"docs state defaults their options do not have (file, option, said, the CLI's): {wrong}"
