"""Fake part packages, as pip installs them (a ``.dist-info`` folder and a data file each), for the
tests of :mod:`worker.models.parts` and of a split GGUF's faults."""

from __future__ import annotations

import uuid
from pathlib import Path


def make_parts(site: Path, contents: list[bytes], *, version: str = "1.0", skip: tuple[int, ...] = ()) -> list[str]:
    """Install fake part distributions ``<prefix>-part1 ...`` into ``site`` (one data/partNN.bin
    each, listed in its RECORD); returns their names in part order. ``skip``: part numbers not
    installed. Names are unique per call (importlib.metadata caches by path)."""
    prefix = f"fake-{uuid.uuid4().hex[:8]}"
    names = []
    for i, data in enumerate(contents, 1):
        name = f"{prefix}-part{i}"
        names.append(name)
        if i in skip:
            continue
        module = name.replace("-", "_")
        (site / module / "data").mkdir(parents=True)
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{module}/__init__.py,,\n{module}/data/part{i:02d}.bin,,\n"
                                     f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return names
