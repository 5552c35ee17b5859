"""worker/models/llama/extension.py: a kernel's first build says so; later processes import it silently;
a new build removes its kernel's builds, and the abandoned builds of any kernel, that have not been used
for a day; a build under way in another process is waited for, a build whose process died is built again."""

from __future__ import annotations

import logging
import os
import time

import pytest

torch = pytest.importorskip("torch")

from worker.models.llama import extension  # noqa: E402


DAY_S = 24 * 3600.0


def aged(path, age_s: float) -> None:
    """Set the times of ``path`` and, for a folder, of its files to ``age_s`` seconds ago (files first:
    writing one sets its folder's time)."""
    when = time.time() - age_s
    for f in (path.iterdir() if path.is_dir() else ()):
        os.utime(f, (when, when))
    os.utime(path, (when, when))


def a_build(kernels, key: str, prefix: str, age_s: float, *, failed: bool = False):
    """A build folder as torch's builder leaves it: its ``build.ninja`` naming the extension and, unless
    the build ``failed``, the ``.so``; aged ``age_s``."""
    folder = kernels / key
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text(f"cflags = -DTORCH_EXTENSION_NAME=slotserve_{prefix}_{key} -O3\n")
    if not failed:
        (folder / f"slotserve_{prefix}_{key}.so").write_bytes(b"\x7fELF")
    aged(folder, age_s)
    return folder


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """``(kernels folder, build())``: a cache under ``tmp_path``; ``build()`` builds kernel ``k`` of a
    source there with the compiler stubbed (it records each load's folder in ``build.folders``)."""
    from torch.utils import cpp_extension

    source = tmp_path / "k.cpp"
    source.write_text("// a kernel\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SLOTSERVE_NO_KERNELS", raising=False)
    monkeypatch.setattr(extension, "cpu_has", lambda flag: True)
    folders = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: folders.append(kw["build_directory"]) or "module")

    def build():
        return extension.build("k", source, ["-O3"], "avx512_bf16", "pure torch runs")

    build.folders = folders
    return tmp_path / "cache" / "slotserve" / "kernels", build


def test_a_first_build_says_what_it_compiles_and_where_it_caches_it(kernels, monkeypatch, caplog):
    """A fresh machine's first start compiles for about a minute: the log says so (at the default
    level, a warning), naming the source and the cache folder; a build that fails says what runs instead."""
    from torch.utils import cpp_extension

    cache, build = kernels
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert build() == "module"
    (record,) = caplog.records
    assert "compiling k.cpp" in record.getMessage() and str(cache) in record.getMessage()
    assert build.folders[0].startswith(str(cache))

    caplog.clear()
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(RuntimeError("no g++")))
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert build() is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["compiling k.cpp for this machine: once per "
                                                                      "machine and torch version, about a minute on 2 cores",
                                                                      "k.cpp not built"]
    assert caplog.records[1].getMessage().endswith("pure torch runs")


def test_a_cache_that_cannot_hold_the_build_folder_falls_back_without_a_crash(kernels, tmp_path, monkeypatch, caplog):
    """Where the build folder cannot be made (a read-only or full cache; here a file where a folder of
    its path goes, which stops root too), the kernel is not built and the warning says what runs
    instead: the worker starts on the fallback, as where the compiler fails."""
    _, build = kernels
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert build() is None
    assert build.folders == []  # no compile tried
    (record,) = caplog.records
    assert record.getMessage().startswith("k.cpp not built: cannot make its build folder " + str(tmp_path))
    assert record.getMessage().endswith("pure torch runs")


def test_without_a_home_folder_the_kernel_falls_back_without_a_crash(kernels, monkeypatch, caplog):
    """HOME unset, no XDG_CACHE_HOME and a uid with no passwd entry: no cache folder can be named, and
    the kernel is not built, as where its folder cannot be made (failed before: pathlib's RuntimeError
    failed the model's load)."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    _, build = kernels
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert build() is None
    assert build.folders == []  # no compile tried
    (record,) = caplog.records
    assert record.getMessage().startswith("k.cpp not built: no cache folder for slotserve")
    assert "set XDG_CACHE_HOME or HOME" in record.getMessage() and record.getMessage().endswith("pure torch runs")


def abandoned(kernels, key: str, age_s: float, *files: str):
    """A build folder whose build died before torch's builder wrote its ``build.ninja`` (killed while
    starting): empty, or holding ``files`` (the ``lock`` the builder takes first); aged ``age_s``."""
    folder = kernels / key
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"")
    aged(folder, age_s)
    return folder


def test_a_new_build_removes_its_kernels_other_builds_unused_for_a_day(kernels):
    """Every edit of a kernel's source made a build kept forever (~2 MB each, a hundred on a developer's
    machine). A new build removes its kernel's builds that no process has used for a day, and the builds of
    any kernel that died before naming it (they were kept forever too), and nothing else."""
    cache, build = kernels
    stale = a_build(cache, "a" * 16, "k", 2 * DAY_S)
    failed = a_build(cache, "b" * 16, "k", 2 * DAY_S, failed=True)  # (no .so: its build.ninja names it)
    recent = a_build(cache, "c" * 16, "k", DAY_S - 3600)  # (another torch's, say: used an hour ago)
    other_kernel = a_build(cache, "d" * 16, "k2", 2 * DAY_S)
    other_failed = a_build(cache, "1" * 16, "k2", 2 * DAY_S, failed=True)  # (k2's: its build.ninja says so)
    empty = abandoned(cache, "e" * 16, 2 * DAY_S)  # (says whose it is nowhere: its build died at once)
    locked = abandoned(cache, "2" * 16, 2 * DAY_S, "lock")  # (died holding the builder's lock)
    starting = abandoned(cache, "3" * 16, 60.0, "lock")  # (a build starting in another process, a minute ago)
    just_made = abandoned(cache, "4" * 16, 0.0)  # (... or this instant: not locked yet)
    a_file = cache / ("5" * 16)  # (a file, not a build folder)
    a_file.write_bytes(b"")
    aged(a_file, 2 * DAY_S)
    not_a_build = cache / "notes"
    not_a_build.mkdir()
    aged(not_a_build, 2 * DAY_S)
    leftover = a_build(cache, ".removing-" + "f" * 16 + ".1", "k", 0)  # (a prune that stopped midway)
    assert build() == "module"
    current = build.folders[0].rsplit("/", 1)[1]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [current, recent.name, other_kernel.name, other_failed.name, starting.name, just_made.name, a_file.name,
         not_a_build.name])
    assert not any(p.exists() for p in (stale, failed, empty, locked, leftover))


def test_a_prune_of_another_kernel_removes_abandoned_builds_too(tmp_path):
    """An abandoned build names no kernel: whichever kernel builds next removes it (once a day old), and
    says so; a build of its own key keeps it (it is the folder that build uses)."""
    old = abandoned(tmp_path, "a" * 16, 2 * DAY_S, "lock")
    mine = abandoned(tmp_path, "b" * 16, 2 * DAY_S)
    assert extension.prune(tmp_path, "k2", keep=mine.name) == [old.name]
    assert not old.exists() and mine.exists() and [p.name for p in tmp_path.iterdir()] == [mine.name]
    assert extension.prune(tmp_path, "k", keep="0" * 16, stale_after_s=3 * DAY_S) == [] and mine.exists()


def test_a_build_starting_in_an_abandoned_folder_marks_it_used_first(kernels, monkeypatch):
    """A build whose key's folder was abandoned a day ago (its build killed while starting) uses it
    again: it is marked used before the builder runs, so another process's prune meanwhile (its own
    new build of another kernel) keeps it rather than removing the folder under the build."""
    from torch.utils import cpp_extension

    cache, build = kernels
    build()  # (the stubbed compiler: the key's folder, empty)
    folder = cache / build.folders[0].rsplit("/", 1)[1]
    aged(folder, 2 * DAY_S)
    pruned = []
    load = cpp_extension.load

    def load_while_another_process_prunes(**kw):
        pruned.append(extension.prune(cache, "k2", keep="0" * 16))
        return load(**kw)

    monkeypatch.setattr(cpp_extension, "load", load_while_another_process_prunes)
    assert build() == "module" and build.folders == [str(folder)] * 2
    assert pruned == [[]] and folder.exists()


def test_an_import_marks_its_build_used_so_another_build_keeps_it(kernels, monkeypatch):
    """A process importing a build touches its folder first: a build of the same kernel made elsewhere
    meanwhile (another checkout's source) does not remove a build in use, however old it is."""
    cache, build = kernels
    build()  # (the stubbed compiler: the folder, without the .so)
    folder = cache / build.folders[0].rsplit("/", 1)[1]
    (folder / f"slotserve_k_{folder.name}.so").write_bytes(b"\x7fELF")
    aged(folder, 30 * DAY_S)
    imported = []
    monkeypatch.setattr(extension, "_import", lambda name, built: imported.append(name) or "imported module")
    assert build() == "imported module" and imported == [f"slotserve_k_{folder.name}"]
    assert len(build.folders) == 1  # (imported, not built again)
    assert time.time() - folder.stat().st_mtime < 3600
    assert extension.prune(cache, "k", keep="0" * 16) == []  # a new build of k elsewhere keeps it
    assert folder.exists()
    aged(folder, 30 * DAY_S)
    assert extension.prune(cache, "k", keep="0" * 16) == [folder.name] and not folder.exists()


def test_a_build_gone_meanwhile_is_skipped(kernels, monkeypatch):
    """Two processes building at once both prune: the folder one of them renamed away is skipped by the
    other (its rename fails), not an error of the build."""
    cache, build = kernels
    gone = a_build(cache, "a" * 16, "k", 2 * DAY_S)
    taken = a_build(cache, "b" * 16, "k", 2 * DAY_S)
    rename = type(gone).rename

    def raced(self, target):
        if self.name == gone.name:  # another process moved it first
            rename(self, self.with_name(".removing-" + self.name + ".other"))
            raise FileNotFoundError(self)
        return rename(self, target)

    monkeypatch.setattr(type(gone), "rename", raced)
    assert build() == "module"
    assert not taken.exists() and not gone.exists()
    assert [p.name for p in cache.glob(".removing-*")] == [f".removing-{gone.name}.other"]  # (the other's to delete)


def like_torchs_builder(folders):
    """A stub of ``cpp_extension.load`` that takes torch's builder's lock as it does (``FileBaton`` on the
    build folder's ``lock``) and records the folder; where that file is there already, torch's builder
    would poll for it forever: the stub raises instead (the test fails rather than hangs)."""
    from torch.utils.file_baton import FileBaton

    def load(**kw):
        baton = FileBaton(os.path.join(kw["build_directory"], "lock"))
        if not baton.try_acquire():
            raise AssertionError(f"torch's builder would wait forever on {baton.lock_file_path}")
        folders.append(kw["build_directory"])
        baton.release()
        return "module"

    return load


def test_a_build_killed_during_its_build_leaves_a_lock_that_the_next_build_removes(kernels, monkeypatch, caplog):
    """A worker killed (SIGKILL, the OOM killer) during its first kernel build left torch's builder's
    ``lock``, and every later process of that key waited for it forever in cpp_extension.load. Holding
    our own OS lock, a build knows that no live builder holds torch's: it removes the stale one, says so,
    and builds."""
    from torch.utils import cpp_extension

    cache, build = kernels
    build()  # (the stubbed compiler: the key's folder)
    folder = cache / build.folders[0].rsplit("/", 1)[1]
    (folder / f"slotserve_k_{folder.name}.so").write_bytes(b"\x7fELF")  # (maybe half written: not imported)
    (folder / "lock").write_bytes(b"")
    loads = []
    monkeypatch.setattr(cpp_extension, "load", like_torchs_builder(loads))
    monkeypatch.setattr(extension, "_import", lambda name, built: pytest.fail("imported a build that died"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert build() == "module"
    assert loads == [str(folder)] and not (folder / "lock").exists()
    assert [r.getMessage().split(" for this")[0] for r in caplog.records] == [
        f"removed the lock of a build of k.cpp that died in {folder}: building again", "compiling k.cpp"]


HOLDER = """
import fcntl, os, sys
folder = sys.argv[1]
fd = os.open(os.path.join(folder, sys.argv[2]), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
open(os.path.join(folder, "lock"), "w").close()  # (torch's builder's, taken as a build starts)
print("building", flush=True)
if sys.stdin.readline() == "finish\\n":
    open(os.path.join(folder, sys.argv[3]), "wb").write(b"ELF")
    os.remove(os.path.join(folder, "lock"))
"""


@pytest.fixture
def another_build(kernels):
    """``(folder, process)``: another process building kernel ``k`` in its key's folder, holding the build
    lock and torch's ``lock``; it writes ``finish`` to its stdin to end the build (the ``.so`` written,
    the lock removed), or is killed. Always reaped."""
    import subprocess
    import sys

    cache, build = kernels
    build()  # (the stubbed compiler: the key's folder)
    folder = cache / build.folders.pop().rsplit("/", 1)[1]
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), extension.BUILD_LOCK,
                                f"slotserve_k_{folder.name}.so"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "building\n"
        yield folder, process
    finally:
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()


def build_in_a_thread(build):
    """``(thread, result, waiting)``: ``build()`` running in a thread, its return value appended to
    ``result``; ``waiting`` is set when it logs that it waits for another process's build."""
    import threading

    waiting = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("waiting for another process's build of k.cpp"):
                waiting.set()

    handler = Waiting()
    extension.log.addHandler(handler)
    result = []
    thread = threading.Thread(target=lambda: result.append(build()), daemon=True)
    thread.start()
    thread.handler = handler
    return thread, result, waiting


def test_a_build_under_way_in_another_process_is_waited_for_and_imported(kernels, another_build, monkeypatch):
    """A second process starting while the first builds waits (no second build at once), then imports
    what the first built."""
    cache, build = kernels
    folder, process = another_build
    imported = []
    monkeypatch.setattr(extension, "_import", lambda name, built: imported.append(built) or "imported module")
    thread, result, waiting = build_in_a_thread(build)
    try:
        assert waiting.wait(timeout=30)
        assert build.folders == [] and imported == [] and thread.is_alive()
        process.stdin.write("finish\n")
        process.stdin.flush()
        thread.join(timeout=30)
        assert result == ["imported module"] and build.folders == []
        assert imported == [folder / f"slotserve_k_{folder.name}.so"]
    finally:
        extension.log.removeHandler(thread.handler)


def test_a_build_waited_for_whose_process_dies_is_built_again(kernels, another_build, monkeypatch):
    """A second process waiting for a build whose process is killed (torch's ``lock`` left behind) does
    not wait forever: it removes that lock and builds."""
    from torch.utils import cpp_extension

    cache, build = kernels
    folder, process = another_build
    monkeypatch.setattr(cpp_extension, "load", like_torchs_builder(build.folders))
    thread, result, waiting = build_in_a_thread(build)
    try:
        assert waiting.wait(timeout=30)
        process.kill()
        process.wait()
        thread.join(timeout=30)
        assert result == ["module"] and build.folders == [str(folder)] and not (folder / "lock").exists()
    finally:
        extension.log.removeHandler(thread.handler)


def test_where_no_os_lock_can_be_had_a_lock_of_torchs_is_left_alone(kernels, monkeypatch):
    """On a filesystem without flock the build runs unlocked, as before: it cannot tell a stale ``lock``
    from a live build's, so it leaves it to torch's builder."""
    import errno
    import fcntl

    from torch.utils import cpp_extension

    cache, build = kernels
    build()
    folder = cache / build.folders[0].rsplit("/", 1)[1]
    (folder / "lock").write_bytes(b"")
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append((folder / "lock").exists()) or "module")
    assert build() == "module" and seen == [True]


FAKE_CXX = """
import subprocess, sys
if "-c" not in sys.argv:  # (torch's builder asks the compiler's version first)
    print("12.2.0")
    sys.exit(0)
# the compiler proper, as g++ runs cc1plus: a child of the driver, here reading the test's FIFO to its end
subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read()", {fifo!r}])
"""


class Interrupted(BaseException):
    pass


def test_an_interrupted_build_ends_the_compilers_ninja_started(tmp_path, monkeypatch):
    """A build stopped during its compile (a worker's stop during its first load: the stop flag's
    ``interrupting`` raises in torch's wait for ninja) left the compilers ninja had started running on
    their own: torch's ``subprocess.run`` SIGKILLs ninja, whose jobs (each in its own process group)
    outlive it. Now ninja gets SIGTERM, stops its jobs' process groups and waits for them: no process of
    the build is left. Real torch builder, real ninja, a fake slow compiler (the driver and its child,
    held on a FIFO the test holds); the stop comes as :func:`slotserve.signals.watch_parent`'s does."""
    import shutil
    import sys
    import threading

    psutil = pytest.importorskip("psutil")
    if shutil.which("ninja") is None:
        pytest.skip("no ninja")
    from slotserve.signals import StopSignals
    from tests.support.waits import wait_until

    fifo = str(tmp_path / "cc.fifo")
    os.mkfifo(fifo)
    writer = [os.open(fifo, os.O_RDWR)]  # (the compiler's read waits on it until closed)
    cxx = tmp_path / "bin" / "g++"  # (a name torch's builder accepts without a warning)
    cxx.parent.mkdir()
    cxx.write_text(f"#!{sys.executable}\n" + FAKE_CXX.format(fifo=fifo))
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("MAX_JOBS", "1")
    source = tmp_path / "k.cpp"
    source.write_text("// a kernel\n")
    (tmp_path / "build").mkdir()

    def build_processes():  # (ninja's job: its shell, the fake compiler, its child: each names tmp_path)
        return [p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
                and any(str(tmp_path) in a for a in p.info["cmdline"] or ())]

    def let_go():  # (the compiler's read ends: a build that was not stopped ends by itself, the test fails)
        if writer:
            os.close(writer.pop())

    returned = threading.Event()
    try:
        with StopSignals() as sig:
            def stop_when_compiling():
                try:
                    wait_until(lambda: any(fifo in p.info["cmdline"] for p in build_processes()), 120,
                               "the fake compiler's child", pause_s=0.05)
                    sig.flag.set("test")
                    assert sig.flag.interrupt_main()
                finally:
                    if not returned.wait(60):
                        let_go()

            stopper = threading.Thread(target=stop_when_compiling)
            stopper.start()
            try:
                with pytest.raises(Interrupted):
                    with sig.flag.interrupting(Interrupted):
                        extension._compile("slotserve_k_interrupted", source, [], tmp_path / "build", "pure torch")
            finally:
                returned.set()
                stopper.join(130)
        assert writer, "the build was not stopped: it ended when the test let its compiler go"
        wait_until(lambda: not build_processes(), 10, "the build's processes to end", show=build_processes,
                   pause_s=0.05)
    finally:
        let_go()
        for p in build_processes():
            p.kill()
