"""A stop signal during a worker's model load ends it promptly and cleanly (an adversarial pass found
SIGTERM taken only once the load was done: 7.5 s for a 0.5B GGUF, minutes on a first start that builds
kernels, past a process manager's grace before SIGKILL). ``slotserve worker`` on SIGTERM or SIGINT,
and the worker process ``slotserve up`` / ``serve`` start on SIGTERM, exit with status 0 while the load
is held open (tests/support/held_load.py: the load waits on a child process, as a kernel build waits
on its compiler), the child killed and reaped, the broker told the worker left. The stop flag's
``interrupting`` alone, in process. Real processes, real signals, waits with deadlines."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

psutil = pytest.importorskip("psutil")

from client import Client  # noqa: E402
from slotserve.signals import SignalStopFlag, StopSignals  # noqa: E402
from tests.support.cluster import free_port  # noqa: E402
from tests.support.held_load import held_worker_main, load_child  # noqa: E402
from tests.support.subreaper import reaped  # noqa: E402
from tests.support.waits import wait_until as _wait_until  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

pytestmark = pytest.mark.process

wait_until = functools.partial(_wait_until, pause_s=0.05)  # (process tables and a broker's status: polled)
PROMPT_S = 20.0  # the held load never ends by itself: any exit within this is the signal's


@pytest.fixture(scope="module")
def broker():
    """``(frontend, backend)`` of a ``slotserve broker`` process."""
    front, back = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    proc = subprocess.Popen([sys.executable, "-m", "slotserve", "broker", "--frontend", front, "--backend", back],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield front, back
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.fixture
def fifo(tmp_path):
    """A FIFO whose writer the test holds: a held load's child reads it until the test ends."""
    path = str(tmp_path / "load.fifo")
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR)  # (never blocks on Linux; the reader's read waits on it)
    yield path
    os.close(writer)


def loading(front: str, name: str) -> int:
    with Client(front, connect_timeout_s=2) as c:
        m = c.status().models.get(name)
        return 0 if m is None else m.loading


def held_and_announced(pid: int, fifo: str, front: str, name: str):
    """Wait until the worker ``pid`` runs its held load's child and the broker lists it loading;
    returns the child."""
    proc = psutil.Process(pid)
    child = wait_until(lambda: load_child(proc, fifo), 60, "the held load's child process")
    wait_until(lambda: loading(front, name) == 1, 60, "the broker to list the worker as loading")
    return child


def stopped_cleanly(child, front: str, name: str) -> None:
    """The load's child is gone (killed and reaped), and the broker lists no worker loading the model."""
    _, alive = psutil.wait_procs([child], timeout=PROMPT_S)
    assert not alive, f"the load's child {child.pid} was left behind"
    wait_until(lambda: loading(front, name) == 0, 30, "the broker to hear the worker left")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_slotserve_worker_stops_at_once_during_its_model_load(broker, fifo, sig):
    front, back = broker
    name = f"held-{sig.name.lower()}"
    worker = subprocess.Popen([sys.executable, "-m", "tests.support.held_load", fifo, "worker", "--broker", back,
                               "--slots", "2", "--served-model-name", name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = held_and_announced(worker.pid, fifo, front, name)
        worker.send_signal(sig)
        _, err = worker.communicate(timeout=PROMPT_S)
        assert worker.returncode == 0, err
        assert "Traceback" not in err, err
        stopped_cleanly(child, front, name)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.communicate(timeout=10)


def test_a_launched_worker_stops_at_once_on_sigterm_during_its_model_load(broker, fifo):
    """The worker process of ``slotserve up`` / ``serve`` (slotserve.launcher.worker_main): SIGTERM,
    what its parent's stop and a process manager send."""
    front, back = broker
    config = WorkerConfig(broker=back, model="simulated", num_slots=2, served_model_names=("held-launched",))
    p = multiprocessing.get_context("spawn").Process(target=held_worker_main, args=(fifo, config))
    p.start()
    try:
        child = held_and_announced(p.pid, fifo, front, "held-launched")
        p.terminate()
        p.join(PROMPT_S)
        assert p.exitcode == 0, p.exitcode
        stopped_cleanly(child, front, "held-launched")
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)


GRACE_S = 120.0  # the orphaned worker's stop_timeout_s: past it, its parent watch ends it with os._exit(1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
def test_a_launched_worker_whose_parent_is_killed_during_its_model_load_stops_at_once(broker, fifo):
    """The worker process of ``slotserve up`` / ``run``, its load held, its parent SIGKILLed: the worker
    stops at once (where it waited out its grace, then ``os._exit(1)``: the parent watch only set the
    flag, which a load never looks at), exit status 0, the load's child killed and reaped by it, the
    broker told it left, the log saying why. A subreaper above the parent reaps the orphaned worker
    and reports its exit status and when it ended (tests/support/subreaper.py)."""
    front, back = broker
    tree = subprocess.Popen([sys.executable, "-m", "tests.support.subreaper", sys.executable, "-m",
                             "tests.support.held_load", "--parent", "worker", fifo, back, str(GRACE_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        parent = psutil.Process(int(tree.stdout.readline().split()[1]))
        worker = wait_until(lambda: next((k for k in parent.children() if load_child(k, fifo)), None), 60,
                            "the parent's worker to run its held load")  # (its other child: the resource tracker)
        child = held_and_announced(worker.pid, fifo, front, "held-orphan")
        parent.kill()
        killed_at = time.monotonic()
        out, err = tree.communicate(timeout=PROMPT_S)  # (the subreaper ends once every orphan did)
        ends = reaped(out)
        assert ends[parent.pid][0] == -signal.SIGKILL
        code, ended_at = ends[worker.pid]
        assert code == 0 and ended_at - killed_at < PROMPT_S < GRACE_S, (code, ended_at - killed_at, err)
        assert child.pid not in ends  # (killed and reaped by the worker, not left to the subreaper)
        assert f"the parent process {parent.pid} is gone: stopping" in err
        assert "stopped during the model's load" in err
        assert "did not stop within" not in err and "Traceback" not in err, err
        stopped_cleanly(child, front, "held-orphan")
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)
        tree.communicate(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
def test_a_launched_gateway_whose_parent_is_killed_while_a_tokenizer_loads_stops_at_once(broker, fifo):
    """The HTTP gateway of ``slotserve up`` / ``serve``, its parent SIGKILLed while it starts (its
    tokenizer loading, held): it stops at once, exit status 0, where its event loop's close waited for
    the load's thread (the loop's default executor: seconds for a local tokenizer, minutes for a
    download), past its grace, then ``os._exit(1)``. The load is abandoned on its daemon thread."""
    front, _ = broker
    tree = subprocess.Popen([sys.executable, "-m", "tests.support.subreaper", sys.executable, "-m",
                             "tests.support.held_load", "--parent", "gateway", fifo, front, str(GRACE_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        parent = psutil.Process(int(tree.stdout.readline().split()[1]))
        wait_until(lambda: os.path.exists(fifo + ".loading"), 60, "the gateway to load its tokenizer")
        gateway = next(k for k in parent.children() if title(k).startswith("slotserve gateway "))
        parent.kill()
        killed_at = time.monotonic()
        out, err = tree.communicate(timeout=PROMPT_S)
        ends = reaped(out)
        code, ended_at = ends[gateway.pid]
        assert code == 0 and ended_at - killed_at < PROMPT_S < GRACE_S, (code, ended_at - killed_at, err)
        assert f"the parent process {parent.pid} is gone: stopping" in err
        assert "did not stop within" not in err and "Traceback" not in err, err
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)
        tree.communicate(timeout=10)


def title(p) -> str:
    """``p``'s process title (its command line as ``ps`` shows it), or "" once it is gone."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


class Interrupted(BaseException):
    pass


def test_interrupting_raises_on_the_main_thread_once_and_only_inside():
    with StopSignals() as sig:
        with pytest.raises(Interrupted, match=f"stop asked for \\({int(signal.SIGTERM)}\\)"):
            with sig.flag.interrupting(Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                sig.wait(10)  # (the signal's handler raises in this wait, or before it)
        assert sig.flag.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # outside: only the flag
        sig.wait(10)
        assert sig.flag.count == 2
        with pytest.raises(Interrupted):  # set already: at once
            with sig.flag.interrupting(Interrupted):
                pytest.fail("entered with the flag set")
    flag = SignalStopFlag()
    with flag.interrupting(Interrupted):
        t = threading.Thread(target=flag.set, args=("parent gone",))  # another thread's set raises nothing
        t.start()
        t.join(10)
    assert flag.reason == "parent gone"


def test_interrupt_main_breaks_a_blocking_call_of_the_main_thread_from_another_thread():
    """What the parent watch does once the parent is gone: the flag set on its thread, the main thread,
    blocked in a read that nothing will ever answer (as in a kernel build's wait for ninja), raises at
    once. Outside ``interrupting``, or where SIGTERM has no Python handler, it sends nothing."""
    r, w = os.pipe()
    try:
        with StopSignals() as sig:
            assert not sig.flag.interrupt_main()  # (outside: nothing sent, nothing raised)
            with pytest.raises(Interrupted, match=r"stop asked for \(parent gone\)"):
                with sig.flag.interrupting(Interrupted):
                    def stop_from_a_thread():
                        sig.flag.set("parent gone")
                        assert sig.flag.interrupt_main()

                    t = threading.Thread(target=stop_from_a_thread)
                    t.start()
                    os.read(r, 1)  # (blocks: no writer writes)
            t.join(10)
            assert sig.flag.reason == "parent gone" and sig.flag.repeated()
        flag = SignalStopFlag()
        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            with flag.interrupting(Interrupted):
                assert not flag.interrupt_main()  # (SIGTERM would end the process: not sent)
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        os.close(r)
        os.close(w)
