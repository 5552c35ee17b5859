"""Where slotserve's broker spends its time per request, measured without the noise of a shared machine.

``python -m bench.broker --compare-bare`` runs 40,000 short requests through a live cluster and
reads the broker's CPU from ``/proc``; on a 2-core machine shared with others that number moves by
10 % between runs, too much to see a 0.3 us change. This script instead

1. **records** every frame the broker receives in that same workload (the throughput run of
   :func:`bench.broker.bench_throughput`: 2 zero-cost workers, 64 slots each, 3-token prompts,
   ``max_tokens=4``), with its socket, sender and arrival time, and its housekeeping ticks;
2. **replays** them into a fresh :class:`~broker.server.BrokerServer` whose sockets only count
   what would be sent (so its sends are encoded, split and accounted for as in a live run, and the
   broker keys, workers and credits come out the same), ``--repeat`` times, and prints the median
   microseconds per request of the whole handling (decode, core, encode), the floor of a bare
   decode + encode of the same frames, and with ``--profile`` the top functions by own time
   (cProfile; its own overhead inflates small functions, so read them as shares). Times are the
   thread's CPU time (``time.thread_time``): a busy machine delays a replay, which wall time would
   count, but takes little of its CPU time (the caches it shares still do: compare runs made
   one after the other, best of several).

Not measured here: ZeroMQ's own send and receive (the pass-through broker pays the same per
message) and the poll loop. ``--record PATH`` writes the frames (pickle) for later replays
(``--replay PATH``); the default records then replays in one go.

    python -m bench.broker_profile                 # record 40,000 requests, replay 5 times
    python -m bench.broker_profile --profile 25    # and show the 25 costliest functions
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pickle
import pstats
import statistics
import tempfile
import time

import msgpack

from bench.common import ANY_PORT, load_avg
from broker import BrokerConfig
from broker.server import BrokerServer, Side, tune_gc
from client import Client
from slotserve.launcher import ClusterConfig, LocalCluster, _child_setup, _ctx
from worker.config import WorkerConfig

Event = tuple  # ("frame", side value, identity, data, now) or ("tick", now)


class RecordingServer(BrokerServer):
    """A live broker that also keeps every frame it handles and every tick, in order."""

    def __init__(self, config: BrokerConfig) -> None:
        super().__init__(config)
        self.events: list[Event] = []
        tick = self.core.tick

        def recorded_tick(now: float):
            self.events.append(("tick", now))
            return tick(now)
        self.core.tick = recorded_tick

    def _handle(self, side: Side, identity: bytes, data: bytes, now: float) -> None:
        self.events.append(("frame", side.value, identity, data, now))
        super()._handle(side, identity, data, now)


def recording_broker_main(config: BrokerConfig, ready, path: str) -> None:
    """Child process body: a :class:`RecordingServer`; its events are pickled to ``path`` when it stops."""
    stop = _child_setup("slotserve recording broker", "WARNING", 5.0)
    tune_gc()
    with RecordingServer(config) as server:
        ready.put((server.frontend, server.backend))
        server.serve(stop)
        with open(path, "wb") as f:
            pickle.dump(server.events, f, protocol=pickle.HIGHEST_PROTOCOL)


class RecordingCluster(LocalCluster):
    """A :class:`~slotserve.launcher.LocalCluster` whose broker is a :class:`RecordingServer` writing to ``path``."""

    def __init__(self, config: ClusterConfig, path: str) -> None:
        super().__init__(config)
        self.path = path

    def _start_broker(self) -> None:
        ready = _ctx.Queue()
        p = _ctx.Process(target=recording_broker_main, args=(self._broker_cfg, ready, self.path),
                         name="slotserve-recording-broker", daemon=True)
        p.start()
        self._broker = p
        self.frontend, self.backend = self._await_ready(p, ready, "the recording broker")


def record(path: str, n: int, workers: int = 2, slots: int = 64) -> None:
    """Run :func:`bench.broker.bench_throughput`'s workload (warm-up of 5,000, then ``n``) through a
    recording broker; its frames are written to ``path``."""
    from bench.broker import short_prompt

    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT),
                        tuple(WorkerConfig(num_slots=slots) for _ in range(workers)))
    with RecordingCluster(cfg, path) as cl, Client(cl.frontend) as c:
        for i in range(min(5000, n)):
            c.submit_request(short_prompt(i), 4, stop_token=None)
        c.run(timeout=120)
        for i in range(n):
            c.submit_request(short_prompt(i), 4, stop_token=None)
        c.run(timeout=600)


class _CountingSocket:
    """Stands in for a ROUTER socket: takes every frame (counted), never blocks."""

    def __init__(self) -> None:
        self.frames = 0
        self.bytes = 0

    def send_multipart(self, frames, flags=0) -> None:
        self.frames += 1
        self.bytes += len(frames[1])

    def close(self, linger=None) -> None:
        pass


def replay_server() -> BrokerServer:
    """A broker whose sockets are :class:`_CountingSocket`s (bound, then swapped: nothing is sent)."""
    server = BrokerServer(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT))
    for side in (Side.FRONTEND, Side.BACKEND):
        server._sockets[side].close(linger=0)
        server._sockets[side] = _CountingSocket()
    return server


def replay(events: list[Event], profile: cProfile.Profile | None = None) -> tuple[float, BrokerServer]:
    """Feed ``events`` to a fresh :func:`replay_server`, as its loop would; (seconds taken, the server)."""
    server = replay_server()
    sides = {s.value: s for s in Side}
    handle, perform, tick = server._handle, server._perform, server.core.tick
    if profile is not None:
        profile.enable()
    t0 = time.thread_time()
    for ev in events:
        if ev[0] == "frame":
            handle(sides[ev[1]], ev[2], ev[3], ev[4])
        else:
            perform(tick(ev[1]))
    dt = time.thread_time() - t0
    if profile is not None:
        profile.disable()
    return dt, server


def bare(events: list[Event]) -> float:
    """Seconds to unpack every recorded frame and pack it back: the least any broker in Python does."""
    frames = [ev[3] for ev in events if ev[0] == "frame"]
    t0 = time.thread_time()
    for data in frames:
        msgpack.packb(msgpack.unpackb(data, raw=False, use_list=False))
    return time.thread_time() - t0


def requests_in(events: list[Event]) -> int:
    """Requests submitted in the recorded frames."""
    n = 0
    for ev in events:
        if ev[0] == "frame" and ev[1] == Side.FRONTEND.value:
            d = msgpack.unpackb(ev[3], raw=False)
            if d.get("op") == "submit":
                n += len(d["requests"])
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40_000, help="requests after the warm-up (default 40,000)")
    ap.add_argument("--record", metavar="PATH", help="only record, to PATH")
    ap.add_argument("--replay", metavar="PATH", help="replay PATH's frames instead of recording")
    ap.add_argument("--repeat", type=int, default=5, help="replays timed (default 5; the median is printed)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="also profile one replay: top N by own time")
    args = ap.parse_args(argv)
    path = args.replay or args.record or os.path.join(tempfile.mkdtemp(), "broker_frames.pickle")
    if not args.replay:
        record(path, args.requests)
        if args.record:
            print(f"recorded to {path}")
            return
    with open(path, "rb") as f:
        events = pickle.load(f)
    tune_gc()
    n = requests_in(events)
    frames = sum(1 for ev in events if ev[0] == "frame")
    load0 = load_avg()
    times = []
    for _ in range(args.repeat):
        dt, server = replay(events)
        times.append(dt)
    front, back = server._sockets[Side.FRONTEND], server._sockets[Side.BACKEND]
    floor = statistics.median(bare(events) for _ in range(args.repeat))
    print(f"{n:,} requests, {frames:,} frames in, {front.frames + back.frames:,} out "
          f"({front.frames:,} to clients, {back.frames:,} to workers; {(front.bytes + back.bytes) / n:.0f} bytes "
          f"a request); completed {server.core.counters['completed']:,}")
    print(f"replay: {statistics.median(times) / n * 1e6:.2f} us/request, best {min(times) / n * 1e6:.2f} "
          f"(median of {args.repeat}: "
          f"{', '.join(f'{t / n * 1e6:.2f}' for t in times)}); unpack + pack of the frames alone "
          f"{floor / n * 1e6:.2f} us/request (load {load0:.2f} -> {load_avg():.2f})")
    if args.profile:
        prof = cProfile.Profile(time.thread_time)
        replay(events, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
