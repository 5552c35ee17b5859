"""worker.models.threads: the thread count of each step, chosen by timing steps (issue 32, item 4).

The tuner is driven by step times from a cost model (threads -> seconds per step) that the tests
change mid-run, as a machine's load changes; then a real runner at precision gguf: the count the
tuner gives is the one its steps run at, and the tokens do not depend on it.
"""

from __future__ import annotations

import itertools

import pytest

from worker.models.threads import ThreadTuner, others_busy, thread_counts


def drive(tuner: ThreadTuner, cost, steps: int, key=lambda i: (8, 0, 0)) -> list[int]:
    """Run ``steps`` steps; ``cost(threads, i)``: step ``i``'s seconds at that count. The counts used."""
    used = []
    for i in range(steps):
        n = tuner.next_threads()
        used.append(n)
        tuner.record(key(i), cost(n, i))
    return used


def test_the_counts_halve_down_to_one():
    assert thread_counts(1) == (1,)
    assert thread_counts(2) == (1, 2)
    assert thread_counts(8) == (1, 2, 4, 8)
    assert thread_counts(6) == (1, 3, 6)
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match="max_threads"):
            thread_counts(bad)


@pytest.mark.parametrize("kwargs", [{"first_interval": 0}, {"rounds": 0}, {"first_interval": 9, "max_interval": 8},
                                    {"margin": 1.0}, {"margin": -0.1}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ThreadTuner(2, **kwargs)


def test_record_needs_a_count_first():
    t = ThreadTuner(2)
    with pytest.raises(RuntimeError, match="next_threads"):
        t.record((1, 0, 0), 0.1)


def test_a_loaded_machine_moves_the_count_down_and_a_quiet_one_back_up():
    """2 threads are 1.5x faster than 1 while quiet; 3x slower while two other processes run."""
    busy = range(400, 900)

    def cost(n, i):
        if i in busy:
            return {1: 0.10, 2: 0.30}[n]
        return {1: 0.06, 2: 0.04}[n]

    t = ThreadTuner(2)
    current = []
    used = drive(t, lambda n, i: current.append(t.current) or cost(n, i), 1400)
    assert used[0] == 2 and set(current[:400]) == {2}
    # busy from step 400: the count is 1 within a probe interval (max_interval 256) and a probe
    switched = current.index(1)
    assert 400 < switched < 400 + 256 + 10 and set(current[switched:900]) == {1}
    assert used[switched:900].count(1) >= 0.9 * (900 - switched)  # (the rest: probes at 2, every 8, 16, ... steps)
    # quiet again from 900: back to 2 within a probe interval and a probe
    back = current.index(2, 900)
    assert back < 900 + 256 + 10 and set(current[back:]) == {2} and t.changes == 2


def test_while_other_processes_are_busy_more_threads_are_not_probed():
    """The loaded machine of the test above, with ``busy`` saying so during the load: once the count
    is down, no step runs on 2 threads (a probe of more threads is what pays the collapse tails)
    until the load ends; then the count climbs back as before."""
    load = range(100, 900)

    def cost(n, i):
        if i in load:
            return {1: 0.10, 2: 0.30}[n]
        return {1: 0.06, 2: 0.04}[n]

    now = [0]  # the step being run, for busy()
    t = ThreadTuner(2, busy=lambda threads: now[0] in load)
    used = drive(t, lambda n, i: now.__setitem__(0, i + 1) or cost(n, i), 1200)
    down = next(i for i in load if all(u == 1 for u in used[i:i + 20]))
    assert down < 100 + 256 + 10
    assert all(u == 1 for u in used[down:900])  # held at 1 thread: no probe of 2 while busy
    assert used[-1] == 2 and t.changes >= 2  # the quiet machine after the load: back to 2


def test_while_held_by_busy_processes_the_check_grows_rarer():
    """At 1 thread with only more threads to try and other processes busy throughout, the busy check
    (three /proc readings) runs at ever longer intervals, as a probe that keeps the count would."""
    calls = []
    t = ThreadTuner(2, busy=lambda threads: calls.append(threads) or True)
    drive(t, lambda n, i: {1: 0.10, 2: 0.30}[n], 2000)
    assert t.current == 1 and t.changes == 1
    held = [c for c in calls if c == 1]  # the checks made at 1 thread
    assert 5 <= len(held) <= 20 and t.interval == t.max_interval


def test_busy_reads_the_load_average_less_the_own_threads(monkeypatch):
    import os

    from worker.models import threads

    monkeypatch.setattr(threads, "runnable_others", lambda: 0)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.1, 2.0, 1.0))
    assert others_busy(1) and others_busy(2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.4, 2.0, 1.0))
    assert not others_busy(1)
    monkeypatch.setattr(threads, "runnable_others", lambda: 1)  # a task runnable now: busy at once
    assert others_busy(1)

    def unreadable():
        raise OSError("no load average here")

    monkeypatch.setattr(threads, "runnable_others", lambda: 0)
    monkeypatch.setattr(os, "getloadavg", unreadable)
    assert not others_busy(1)


def test_a_process_that_starts_spinning_is_seen_at_once():
    """The load average lags a minute; the runnable count sees a spinning process the moment it runs."""
    import subprocess
    import sys

    from worker.models.threads import runnable_others

    spin = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert spin.stdout.readline().strip() == "spinning"
        assert runnable_others() >= 1  # the spinner is running or waiting for a CPU: state R
        assert others_busy(64)  # whatever the load average says
    finally:
        spin.kill()
        spin.wait()
        spin.stdout.close()


def test_own_threads_are_not_counted_as_others(monkeypatch):
    """This process's own runnable threads (the reader itself at least) are taken off the count."""
    import builtins
    import io

    from worker.models import threads

    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/loadavg":
            return io.StringIO("0.50 0.40 0.30 1/120 4242\n")  # one runnable task: the reader
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert threads.runnable_others() == 0


def test_a_quiet_machine_keeps_every_core_and_probes_ever_less_often():
    t = ThreadTuner(2, max_interval=256)
    used = drive(t, lambda n, i: {1: 0.06, 2: 0.04}[n], 5000)
    assert t.current == 2 and t.changes == 0
    assert t.interval == 256
    probes = used[2000:].count(1)  # one step at 1 thread per probing round, `rounds` rounds per probe
    assert probes <= t.rounds * (3000 // 256 + 1)  # ~2 % of the steps once the interval is at its cap


def test_noise_below_the_margin_does_not_move_the_count():
    jitter = itertools.cycle([1.0, 0.97, 1.03, 0.99, 1.02])
    t = ThreadTuner(2, margin=0.1)
    drive(t, lambda n, i: {1: 0.041, 2: 0.040}[n] * next(jitter), 3000)
    assert t.changes == 0 and t.current == 2


def test_only_steps_of_one_shape_are_compared():
    """Every probe round mixes shapes (a prefill then a decode): no comparison, so no change, even
    though the cheap shape happens to fall on 1 thread; the tuner gives up and probes again later."""
    t = ThreadTuner(2)
    shape = itertools.cycle([(8, 0, 0), (8, 512, 0), (8, 64, 0)])

    def cost(n, i):
        return 0.04

    drive(t, cost, 3000, key=lambda i: next(shape))
    assert t.changes == 0 and t.current == 2


def _drive_told(tuner: ThreadTuner, cost, keys) -> list[tuple[int, int, tuple]]:
    """As :func:`drive`, the runner telling each step's shape beforehand: ``[(count, current, key)]``
    (``current``: the tuner's count when the step was asked for)."""
    used = []
    for key in keys:
        current = tuner.current
        n = tuner.next_threads(key)
        used.append((n, current, key))
        tuner.record(key, cost(n, key))
    return used


def test_told_shapes_a_probe_runs_only_on_steps_of_one_shape():
    """Decode steps with a prefill of another size every 4th step, on a loaded machine where 1 thread
    is 3x cheaper: no prefill runs at a probed count, and the probes still find 1 thread."""
    keys = [(8, 0, 0) if i % 4 else (8, 40 + i % 97, 0) for i in range(1500)]

    def cost(n, key):
        return (0.10 if n == 1 else 0.30) * (1 + key[1] / 10)

    t = ThreadTuner(2)
    used = _drive_told(t, cost, keys)
    assert all(n == current for n, current, key in used if key[1])  # prefills: always the current count
    probed = [key for n, current, key in used if n != current]
    assert len(probed) >= t.rounds and set(probed) == {(8, 0, 0)}
    assert t.current == 1 and t.changes == 1
    assert [n for n, _, _ in used[-500:]].count(1) >= 480


def test_told_shapes_a_probe_waits_for_a_steady_step():
    """Every step another shape: a probe never starts (it could not compare), so every step runs at
    the current count."""
    t = ThreadTuner(2)
    used = _drive_told(t, lambda n, key: 0.04, [(8, i, 0) for i in range(1, 600)])
    assert {n for n, _, _ in used} == {2} and t.changes == 0


def test_a_quiet_machine_ends_a_probe_after_one_clearly_slower_round():
    """``busy`` says quiet: each probe runs one step at 1 thread (2x slower) and keeps 2 threads; with
    ``busy`` unknown (None) each probe runs its ``rounds`` rounds."""
    def cost(n, i):
        return {1: 0.08, 2: 0.04}[n]

    quiet = ThreadTuner(2, busy=lambda threads: False)
    unknown = ThreadTuner(2)
    used_quiet, used_unknown = drive(quiet, cost, 2000), drive(unknown, cost, 2000)
    assert quiet.current == unknown.current == 2 and quiet.changes == unknown.changes == 0
    probes = sum(1 for a, b in zip(used_quiet, used_quiet[1:]) if a == 2 and b == 1) + (used_quiet[0] == 1)
    assert used_quiet.count(1) == probes  # one step a probe
    assert used_unknown.count(1) >= unknown.rounds * probes


def test_a_quiet_machine_still_takes_fewer_threads_that_are_faster():
    """Quiet, but fewer threads are faster (a small model on many cores): the early end does not
    apply, the probe runs its rounds and moves down."""
    t = ThreadTuner(8, busy=lambda threads: False)
    drive(t, lambda n, i: {1: 0.08, 2: 0.03, 4: 0.05, 8: 0.07}[n], 3000)
    assert t.current == 2


def test_one_thread_has_nothing_to_choose():
    t = ThreadTuner(1)
    assert drive(t, lambda n, i: 0.05, 100) == [1] * 100


def test_a_wide_machine_climbs_one_neighbour_at_a_time():
    """8 cores, 2 of them free: 2 threads is best. From 8 the count walks 8 -> 4 -> 2 and stays."""
    t = ThreadTuner(8)
    used = drive(t, lambda n, i: {1: 0.08, 2: 0.05, 4: 0.09, 8: 0.20}[n], 3000)
    assert t.current == 2
    assert used[-100:].count(2) >= 90  # (a probe: 3 rounds, one step at 1 and one at 4 each)


# -- a real runner -------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from tests.support.tiny_gguf import write_quantized_gguf

    path = str(tmp_path_factory.mktemp("threads") / "tiny-llama.gguf")
    write_quantized_gguf(path, "llama")
    return path


def _kernels_run() -> bool:
    from worker.models.llama import attnkernel, qkernel

    return qkernel.load() is not None and attnkernel.load() is not None


def _greedy(runner, steps: int = 6) -> list[list[int]]:
    from worker.models.base import BatchPlan, SlotInput

    runner.bind_slots(4)
    inputs = [SlotInput(s, [1 + s, 5, 9, 2 + s, 7, 3][: 3 + s]) for s in range(4)]
    out_tokens = []
    for _ in range(steps):
        out = runner.step(BatchPlan(inputs, None))
        for item, tok in zip(inputs, out.tokens):
            item.tokens.append(tok)
        out_tokens.append(list(out.tokens))
    for s in range(4):
        runner.release_slot(s)
    return out_tokens


def test_the_loader_tunes_only_where_the_count_cannot_change_the_results(gguf_path):
    from worker.models import load_model

    if not _kernels_run():
        pytest.skip("the compiled GGUF kernels do not run here: no tuner at all")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert isinstance(load_model(gguf_path, precision="gguf").thread_tuner, ThreadTuner)
        assert load_model(gguf_path, precision="gguf", num_threads=2).thread_tuner is None  # given: fixed
        assert load_model(gguf_path, precision="fp32").thread_tuner is None
        assert load_model(gguf_path, precision="bf16").thread_tuner is None
    finally:
        torch.set_num_threads(saved)


def test_the_step_runs_at_the_tuners_count_with_the_same_tokens(gguf_path):
    """A tuner that flips between 1 and 2 threads every step: torch runs at the count it gives,
    and the greedy tokens equal those of a fixed count of 1 and of 2 (the kernels split work by
    output rows and heads: each element's sums are one thread's)."""
    from worker.models import load_model

    if not _kernels_run():
        pytest.skip("the compiled GGUF kernels do not run here")
    saved = torch.get_num_threads()
    runner = load_model(gguf_path, precision="gguf", num_threads=2)
    try:
        fixed = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            fixed[n] = _greedy(runner)
        assert fixed[1] == fixed[2]

        class Flip:
            def __init__(self):
                self.seen, self.told, self.n = [], [], 1

            def next_threads(self, key=None):
                self.told.append(key)
                self.n = 3 - self.n
                return self.n

            def record(self, key, seconds):
                self.seen.append((self.n, torch.get_num_threads(), key, seconds))

        flip = runner.thread_tuner = Flip()
        assert _greedy(runner) == fixed[1]
        assert [n for n, _, _, _ in flip.seen] == [2, 1, 2, 1, 2, 1]
        assert all(n == running for n, running, _, _ in flip.seen)
        keys = [key for _, _, key, _ in flip.seen]
        assert keys[0] == (0, 3 + 4 + 5 + 6, 0) and keys[1:] == [(4, 0, 0)] * 5  # prompts, then 4 decode rows
        assert flip.told == keys  # each step's shape, told before it ran
        assert all(seconds > 0 for *_, seconds in flip.seen)
    finally:
        runner.thread_tuner = None
        torch.set_num_threads(saved)
