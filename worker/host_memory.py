"""This machine's memory as a process here may use it: :func:`total_bytes` and
:func:`available_bytes`, with the memory cgroup's limit honoured. The one reading for every
caller that sizes something by memory (the KV cache's fit check, the prefix cache's default
budget, `slotserve up`'s sizing, models on demand).

``/proc/meminfo`` (through psutil) describes the whole host, while a container's or a systemd
unit's memory cgroup is what the kernel's OOM killer enforces: a worker in a 4 GiB container on
a 64 GiB host that sized itself by ``MemAvailable`` would be killed, not refused. So:

- total: the smaller of the host's memory (``MemTotal``) and the tightest cgroup limit;
- available: the smaller of the host's ``MemAvailable`` (free plus reclaimable page cache) and,
  under a limit, the limit less the cgroup's working set (its usage less its inactive file
  cache, which the kernel reclaims before an OOM kill: the working set kubelet and ``docker
  stats`` count, so reclaimable cache counts as available on both sides).

cgroup v2: ``memory.max``, ``memory.current`` and ``memory.stat``'s ``inactive_file`` of the
process's cgroup and of each ancestor under the mount (the tightest one binds); v1 (the memory
controller's own hierarchy): ``memory.stat``'s ``hierarchical_memory_limit`` (ancestors included)
and ``total_inactive_file``, and ``memory.usage_in_bytes``. The cgroup is found from
``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (a mount's root: a container sees its own
cgroup as ``/``), once per process (:func:`_located`: reading both files was ~370 of a call's ~740
µs; a process does not move between cgroups on its own), its numbers at each call. v1's "no limit" is a number near 2**63 and v2's is ``max``: no limit then.
Stdlib and psutil only (no torch), so the CLI may call it.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

__all__ = ["Cgroup", "available_bytes", "cgroup_memory", "total_bytes"]


class Cgroup(NamedTuple):
    """The binding memory cgroup limit: ``limit_bytes`` and the bytes ``available`` under it."""

    limit_bytes: int
    available: int


def total_bytes(*, root: str = "/") -> int | None:
    """The memory this process's machine has (bytes), its cgroup's limit if smaller; None where
    unknown. ``root``: where ``/proc`` and ``/sys`` are found (tests give a fake tree)."""
    host = _host(root)
    limit = cgroup_memory(root)
    values = [v for v in (host and host[0], limit and limit.limit_bytes) if v is not None]
    return min(values) if values else None


def available_bytes(*, root: str = "/") -> int | None:
    """The memory this process may still take (bytes): the host's ``MemAvailable``, or less under
    a cgroup limit (the limit less the working set); None where unknown."""
    host = _host(root)
    limit = cgroup_memory(root)
    values = [v for v in (host and host[1], limit and limit.available) if v is not None]
    return min(values) if values else None


def _host(root: str) -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes: psutil's reading of ``/proc/meminfo`` for this machine,
    the fake tree's ``proc/meminfo`` under another ``root``."""
    if root == "/":
        try:
            import psutil

            vm = psutil.virtual_memory()
            return vm.total, vm.available
        except (ImportError, OSError, RuntimeError):
            return None
    fields = _fields(os.path.join(root, "proc/meminfo"))
    if "MemTotal:" not in fields or "MemAvailable:" not in fields:
        return None
    return fields["MemTotal:"] * 1024, fields["MemAvailable:"] * 1024


def cgroup_memory(root: str = "/") -> Cgroup | None:
    """The tightest memory limit on this process's cgroup (v1 or v2) and what is available under
    it, or None: no limit, no cgroup, or files that cannot be read."""
    return _v1(root) or _v2(root)


def _v1(root: str) -> Cgroup | None:
    where = _located(root, "cgroup", os.getpid())
    if where is None:
        return None
    directory, _mount = where
    stat = _fields(os.path.join(directory, "memory.stat"))
    limit = stat.get("hierarchical_memory_limit")
    usage = _number(os.path.join(directory, "memory.usage_in_bytes"))
    if limit is None or usage is None or limit >= 2**62:  # (v1's "unlimited": 2**63 rounded to pages)
        return None
    return Cgroup(limit, max(0, limit - max(0, usage - stat.get("total_inactive_file", 0))))


def _v2(root: str) -> Cgroup | None:
    where = _located(root, "cgroup2", os.getpid())
    if where is None:
        return None
    directory, mount = where
    limits: list[Cgroup] = []
    while True:  # this cgroup, then each ancestor up to the mount: the tightest binds
        limit = _number(os.path.join(directory, "memory.max"))  # ("max": no limit; absent at the root)
        usage = _number(os.path.join(directory, "memory.current"))
        if limit is not None and usage is not None:
            inactive = _fields(os.path.join(directory, "memory.stat")).get("inactive_file", 0)
            limits.append(Cgroup(limit, max(0, limit - max(0, usage - inactive))))
        if os.path.normpath(directory) == os.path.normpath(mount):
            break
        directory = os.path.dirname(directory)
    if not limits:
        return None
    return Cgroup(min(c.limit_bytes for c in limits), min(c.available for c in limits))


@functools.cache
def _located(root: str, fstype: str, pid: int) -> tuple[str, str] | None:
    """:func:`_cgroup_dir` of the memory controller's hierarchy mounted with ``fstype`` (v1's
    ``cgroup``, whose line names ``memory``; v2's ``cgroup2``, whose line names none), found once
    per process (``pid``: a forked child finds its own) and ``root``."""
    if fstype == "cgroup":
        return _cgroup_dir(root, fstype, lambda controllers: "memory" in controllers.split(","))
    return _cgroup_dir(root, fstype, lambda controllers: controllers == "")


def _cgroup_dir(root: str, fstype: str, wanted) -> tuple[str, str] | None:
    """(the directory of this process's cgroup, its mount point) in the hierarchy mounted with
    ``fstype`` whose ``/proc/self/cgroup`` line's controllers pass ``wanted``; None if none."""
    path = None
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            for line in f:
                _id, controllers, cgroup = line.rstrip("\n").split(":", 2)
                if wanted(controllers) and (fstype == "cgroup2") == (_id == "0"):
                    path = cgroup
                    break
        if path is None:
            return None
        with open(os.path.join(root, "proc/self/mountinfo")) as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                mount_root, mount_point, kind, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
                if kind != fstype or (fstype == "cgroup" and "memory" not in options.split(",")):
                    continue
                inside = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
                mount = os.path.join(root, mount_point.lstrip("/"))
                directory = os.path.normpath(os.path.join(mount, inside))
                return (directory if os.path.isdir(directory) else mount), mount
    except (OSError, ValueError, IndexError):
        return None
    return None


def _fields(path: str) -> dict[str, int]:
    """``name value`` lines (``memory.stat``, ``/proc/meminfo``) as a dict; {} if unreadable."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


def _number(path: str) -> int | None:
    """The integer in a one-value cgroup file, None for ``max`` or an unreadable file."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
