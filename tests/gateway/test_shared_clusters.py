"""tests.support.gateway.SharedClusters, the clusters the gateway's test modules run in a row share: one
started per key, the running one handed out again, a dead one replaced, all stopped on close. On
stand-in clusters (processes that say whether they are alive), no process started."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.gateway import SharedClusters


class _Proc:
    def __init__(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive


class _Cluster:
    """What SharedClusters reads of a LocalCluster: its processes, and stop()."""

    def __init__(self) -> None:
        self.broker_process, self.gateway_process, self.worker_processes = _Proc(), _Proc(), [_Proc()]
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1


def _starter():
    made: list[_Cluster] = []

    def start():
        made.append(_Cluster())
        return made[-1]

    return SimpleNamespace(start=start, made=made)


def test_a_key_gets_one_cluster_until_closed():
    shared, s = SharedClusters(), _starter()
    first = shared.get("a", s.start)
    assert shared.get("a", s.start) is first and len(s.made) == 1
    other = shared.get("b", s.start)
    assert other is not first and shared.get("a", s.start) is first and len(s.made) == 2
    shared.close()
    assert (first.stopped, other.stopped) == (1, 1)
    assert shared.get("a", s.start) is not first and len(s.made) == 3  # a new one after the close
    shared.close()
    shared.close()  # (nothing held: nothing stopped twice)
    assert [c.stopped for c in s.made] == [1, 1, 1]


def test_a_cluster_whose_process_died_is_stopped_and_started_again():
    for dies in ("broker_process", "gateway_process", "worker"):
        shared, s = SharedClusters(), _starter()
        first = shared.get("a", s.start)
        if dies == "worker":
            first.worker_processes[0].alive = False
        else:
            getattr(first, dies).alive = False
        again = shared.get("a", s.start)
        assert again is not first and first.stopped == 1 and again.stopped == 0, dies
        shared.close()
        assert again.stopped == 1 and first.stopped == 1, dies
