"""A worker's prefix-cache numbers reach the broker in heartbeats (issue 23 step 3), also while
it is busy: :meth:`worker.link.BrokerLink._keep_alive` without a broker (its sends recorded)."""

from __future__ import annotations

import time

import zmq

from protocol.messages import Heartbeat, PrefixCacheUsage
from worker import SimulatedLLM
from worker.config import WorkerConfig
from worker.link import BrokerLink
from worker.process import WorkerProcess


def link_with(usages: list) -> tuple[BrokerLink, list]:
    """A registered link whose worker reports ``usages`` one after another (the last one from then on)."""
    wp = WorkerProcess(WorkerConfig(broker="tcp://127.0.0.1:1", heartbeat_interval_s=0.5), SimulatedLLM())
    wp.prefix_cache_usage = lambda: usages.pop(0) if len(usages) > 1 else usages[0]
    ctx = zmq.Context.instance()
    pipe = ctx.socket(zmq.PAIR)
    link = BrokerLink(wp, ctx, pipe)
    pipe.close(0)
    sent: list = []
    link.send = sent.append
    link.welcomed = link.registered = True
    link.last_recv = time.monotonic()
    return link, sent


def test_an_idle_worker_heartbeats_with_its_numbers_and_a_busy_one_when_they_change():
    a, b = PrefixCacheUsage(100, 32, 4096, 1 << 20), PrefixCacheUsage(180, 80, 8192, 1 << 20)
    link, sent = link_with([a, a, b])
    try:
        link.last_sent = time.monotonic() - 1.0  # idle for two intervals: a plain heartbeat
        link._keep_alive()
        assert sent == [Heartbeat(progress=0, prefix_cache=a)]
        link.last_sent = time.monotonic() + 60  # busy: iterations go out all the time
        link._keep_alive()  # within the interval of the last report: nothing asked, nothing sent
        link.usage_checked_s -= 1.0
        link._keep_alive()  # an interval later, the same numbers: nothing sent
        assert len(sent) == 1
        link.usage_checked_s -= 1.0
        link._keep_alive()  # changed: sent while busy
        assert sent[1:] == [Heartbeat(progress=0, prefix_cache=b)] and link.usage_sent == b
    finally:
        link.sock.close(0)


def test_a_worker_without_a_prefix_cache_heartbeats_as_before():
    link, sent = link_with([None])
    try:
        link.last_sent = time.monotonic() + 60
        link.usage_checked_s -= 10
        link._keep_alive()
        assert sent == []
        link.last_sent = time.monotonic() - 1.0
        link._keep_alive()
        assert sent == [Heartbeat(progress=0)]
    finally:
        link.sock.close(0)
