"""Blast radius, kind "a reading of this machine's memory": four places read it, each its own way
(the KV cache's fit check and `slotserve up`'s sizing: /proc/meminfo's MemAvailable, each with
its own parser; models on demand: psutil; the prefix cache's default budget: physical pages), and
none honoured a memory cgroup's limit, so a worker in a 4 GiB container sized itself by the
host's 64 GiB and met the OOM killer instead of a refusal. Now worker.host_memory is the one
reading (total and available, the tightest cgroup limit honoured, v1 and v2), and each place calls
it. Cgroup trees are faked under tmp_path (``root``)."""

from __future__ import annotations

import types

import pytest

from protocol.messages import ModelStatus, Status
from worker import host_memory
from worker.host_memory import Cgroup, available_bytes, cgroup_memory, total_bytes

GIB = 2**30
MEMINFO = "MemTotal:       67108864 kB\nMemFree:        1000 kB\nMemAvailable:   50331648 kB\n"  # 64 GiB, 48 free


def _tree(tmp_path, cgroup: str, mountinfo: str, files: dict[str, str]):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def _v2(tmp_path, leaf_max="max", parent_max="max", current=3 * GIB, inactive=GIB):
    """A systemd-style v2 tree: the process in /app.slice/w.service, limits at either level."""
    d = "sys/fs/cgroup/app.slice"
    return _tree(tmp_path, "0::/app.slice/w.service\n", V2_MOUNT, {
        f"{d}/memory.max": f"{parent_max}\n", f"{d}/memory.current": f"{current}\n",
        f"{d}/memory.stat": f"anon 5\ninactive_file {inactive}\nactive_file 7\n",
        f"{d}/w.service/memory.max": f"{leaf_max}\n", f"{d}/w.service/memory.current": f"{current}\n",
        f"{d}/w.service/memory.stat": f"anon 5\ninactive_file {inactive}\n"})


def test_no_cgroup_limit_is_the_hosts_memory(tmp_path):
    root = _v2(tmp_path)
    assert cgroup_memory(root) is None
    assert total_bytes(root=root) == 64 * GIB and available_bytes(root=root) == 48 * GIB


def test_a_v2_limit_bounds_total_and_available_by_its_working_set(tmp_path):
    root = _v2(tmp_path, leaf_max=str(4 * GIB))  # 3 GiB used, 1 GiB of it reclaimable cache
    assert cgroup_memory(root) == Cgroup(4 * GIB, 2 * GIB)
    assert total_bytes(root=root) == 4 * GIB and available_bytes(root=root) == 2 * GIB


def test_a_v2_ancestors_limit_binds_too(tmp_path):
    root = _v2(tmp_path, leaf_max=str(8 * GIB), parent_max=str(5 * GIB))
    assert cgroup_memory(root) == Cgroup(5 * GIB, 3 * GIB)


def test_a_container_sees_its_own_cgroup_as_the_mount_root(tmp_path):
    """In a cgroup namespace /proc/self/cgroup says 0::/ and the mount is the container's cgroup."""
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": f"{4 * GIB}\n",
                                               "sys/fs/cgroup/memory.current": f"{GIB}\n",
                                               "sys/fs/cgroup/memory.stat": "inactive_file 0\n"})
    assert available_bytes(root=root) == 3 * GIB and total_bytes(root=root) == 4 * GIB


def test_a_v1_limit_and_v1s_unlimited(tmp_path):
    mount = "35 25 0:30 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"  # (no cgroup namespace)
    stat = "cache 9\nhierarchical_memory_limit {}\ntotal_inactive_file {}\n"
    root = _tree(tmp_path / "a", "12:memory:/docker/abc\n0::/\n", mount, {
        "sys/fs/cgroup/memory/memory.stat": stat.format(6 * GIB, GIB),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{3 * GIB}\n"})
    assert cgroup_memory(root) == Cgroup(6 * GIB, 4 * GIB)
    assert total_bytes(root=root) == 6 * GIB and available_bytes(root=root) == 4 * GIB
    root = _tree(tmp_path / "b", "12:memory:/docker/abc\n0::/\n", mount, {
        "sys/fs/cgroup/memory/memory.stat": stat.format(9223372036854771712, 0),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{3 * GIB}\n"})
    assert cgroup_memory(root) is None and available_bytes(root=root) == 48 * GIB


def test_unreadable_or_missing_files_are_no_limit_never_an_error(tmp_path):
    root = _tree(tmp_path, "garbage\n", "garbage\n", {})
    assert cgroup_memory(root) is None and total_bytes(root=root) == 64 * GIB
    assert total_bytes(root=str(tmp_path / "nothing")) is None


def test_this_machine_gives_numbers():
    total, available = total_bytes(), available_bytes()
    assert 0 < available <= total


def test_every_reader_uses_it(monkeypatch):
    """The KV cache's fit check, `slotserve up`'s sizing, the prefix cache's default budget and
    models on demand (its whole-memory check and each pass) all take host_memory's numbers."""
    torch = pytest.importorskip("torch")  # noqa: F841 (the llama modules import it)
    from slotserve import demand_supervisor
    from slotserve.demand_supervisor import DemandSupervisor
    from slotserve.on_demand import Refuse
    from slotserve.sizing import Machine
    from worker.config import WorkerConfig
    from worker.models.llama import cache, prefix_cache

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 3 * GIB)
    monkeypatch.setattr(host_memory, "total_bytes", lambda: 4 * GIB)
    assert cache.available_bytes("cpu") == 3 * GIB
    assert Machine.here().available_bytes == 3 * GIB
    assert prefix_cache.default_budget_mb("cpu") == int(min(prefix_cache.DEFAULT_CAP_MB,
                                                           4 * GIB * prefix_cache.DEFAULT_FRACTION / 2**20))
    monkeypatch.setattr(demand_supervisor, "estimate_bytes", lambda model: 5 * GIB)
    config = (WorkerConfig(model="simulated", served_model_names=("a",)),)
    with pytest.raises(ValueError, match="this machine has 4,096 MiB of memory in all"):
        DemandSupervisor(config, 1, 300.0, spawn=None, connect=None)
    monkeypatch.setattr(host_memory, "total_bytes", lambda: 64 * GIB)
    queued = Status("b", 1.0, {"a": ModelStatus(1, 0, 0, 0, 0)}, (), 1, {})
    sup = DemandSupervisor(config, 1, 300.0, spawn=None,
                           connect=lambda: types.SimpleNamespace(status=lambda timeout_s: queued, close=lambda: None))
    (refused,) = sup.run_pass(0.0)
    assert isinstance(refused, Refuse) and "the machine has 3,072 MiB available" in refused.why


def test_the_cgroup_is_found_once_per_process_and_its_numbers_read_each_call(tmp_path, monkeypatch):
    """Finding the cgroup (``/proc/self/cgroup`` and ``/proc/self/mountinfo``) was most of each call
    (~370 of ~740 µs here): a caller polling ``available_bytes`` (models on demand, each pass) paid
    it every time. Its place is kept per process; its numbers are read at each call."""
    root = _v2(tmp_path, leaf_max=str(4 * GIB))
    found = []
    find = host_memory._cgroup_dir
    monkeypatch.setattr(host_memory, "_cgroup_dir", lambda *a: found.append(a[1]) or find(*a))
    assert available_bytes(root=root) == 2 * GIB
    (tmp_path / "sys/fs/cgroup/app.slice/w.service/memory.current").write_text(f"{2 * GIB}\n")  # (1 GiB freed)
    assert available_bytes(root=root) == 3 * GIB and total_bytes(root=root) == 4 * GIB
    assert sorted(found) == ["cgroup", "cgroup2"]  # (v1's and v2's hierarchies: each looked for once)
    monkeypatch.setattr(host_memory.os, "getpid", lambda: -7)  # (another process: a forked child finds its own)
    assert available_bytes(root=root) == 3 * GIB
    assert sorted(found) == ["cgroup", "cgroup", "cgroup2", "cgroup2"]
