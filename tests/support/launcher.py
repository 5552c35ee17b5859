"""A stand-in for :class:`slotserve.launcher.LocalCluster`, for CLI tests of ``slotserve up``
that check what the command would start without starting it."""

from __future__ import annotations


def record_clusters(monkeypatch, http_url: str | None = None) -> list:
    """Replace ``LocalCluster`` by a stand-in whose start, supervise and stop do nothing;
    returns the list that every :class:`~slotserve.launcher.ClusterConfig` it is given is
    appended to. ``http_url``: what its ``http_url`` says (None: no gateway)."""
    import slotserve.launcher

    configs: list = []

    class RecordingCluster:
        frontend, backend = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"

        def __init__(self, cfg) -> None:
            configs.append(cfg)
            self.http_url = http_url

        def start(self, should_stop=None) -> None:
            pass

        def supervise(self, should_stop, wakeup_fd=None) -> None:
            pass

        def stop(self, halt=None, wakeup_fd=None) -> None:
            pass

    monkeypatch.setattr(slotserve.launcher, "LocalCluster", RecordingCluster)
    return configs
