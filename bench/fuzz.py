"""Fuzz a live broker's two sockets for longer than the CI test, and count.

Frames: random bytes, random msgpack values, and valid messages mutated
(a field replaced by a random value, bytes flipped/inserted/deleted,
truncation), sent as 1-3 frame messages to the client socket and the worker
socket. After every ``--check-every`` frames a real client asks for
``status`` (a hang would show as a timeout); at the end the same client
runs real requests and compares them with the in-process engine. Prints
counts (frames tried, error replies, crashes, hangs, handler errors);
writes ``bench/results/fuzz.json``.

    python -m bench.fuzz                  # 200,000 frames
    python -m bench.fuzz --frames 20000
"""

from __future__ import annotations

import argparse
import random
import time

import msgpack
import zmq

from bench.chaos import fault_free
from bench.common import ANY_PORT, RESULTS, machine_record, write_results
from broker import BrokerConfig
from client import BrokerUnavailable, Client
from protocol.codec import encode
from protocol.enums import FinishReason
from protocol.messages import (
    Bye, Cancel, Envelope, Finished, Heartbeat, Hello, Iteration, ModelInfo, Register, StatusQuery, Submit,
)
from protocol.request import RequestParams
from slotserve.launcher import ClusterConfig, LocalCluster
from worker.config import WorkerConfig

LIMIT = 64 * 1024
CORPUS = {
    "frontend": [encode(m) for m in (
        Hello("fuzz"), Heartbeat(), StatusQuery(), Bye("x"), Cancel([1, "a"]),
        Submit("simulated", [Envelope(1, RequestParams([1, 2], 3)),
                             Envelope("b", RequestParams([5], 2, stop_token=[0], priority=2, timeout_s=0.5,
                                                         stop_sequences=[[1, 2]]))]))],
    "backend": [encode(m) for m in (
        Register("simulated", 2, 3, ModelInfo(1000, 64, (0,), False), "fuzz"), Heartbeat(progress=3), Bye(),
        Iteration(ids=[0, 1], tokens=[4, 5], finished=[Finished(0, FinishReason.STOP, prompt_tokens=2)]))],
}


def rand_value(rng: random.Random, depth: int = 0):
    k = rng.randrange(9 if depth < 3 else 7)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if k == 3:
        return rng.choice([0.0, -1.5, float("inf"), float("nan"), 1e308, rng.random()])
    if k == 4:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 12)))
    if k == 5:
        return rng.randbytes(rng.randrange(0, 12))
    if k == 6:
        return rng.choice(["v", "op", "submit", "register", "simulated", "id", ""])
    if k == 7:
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {str(rand_value(rng, depth + 1))[:8]: rand_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


def mutate(rng: random.Random, base: bytes) -> bytes:
    how = rng.randrange(4)
    if how == 0:
        d = msgpack.unpackb(base)
        d[rng.choice(sorted(d) + ["v", "op", "extra"])] = rand_value(rng)
        return msgpack.packb(d)
    if how == 1:
        return base[:rng.randrange(len(base) + 1)]
    data = bytearray(base)
    for _ in range(rng.randrange(1, 5)):
        i = rng.randrange(len(data) + 1)
        data[i:i + rng.randrange(3)] = rng.randbytes(rng.randrange(4))
    return bytes(data)


def frame(rng: random.Random, side: str) -> bytes:
    k = rng.randrange(10)
    if k < 2:
        return rng.randbytes(rng.randrange(0, 300))
    if k < 4:
        return msgpack.packb(rand_value(rng))
    if k == 4 and rng.random() < 0.02:
        return rng.randbytes(LIMIT + rng.randrange(1, 1000))  # over the polite limit: too_large
    return mutate(rng, rng.choice(CORPUS[side]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=200_000, help="messages per socket")
    ap.add_argument("--check-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    machine = machine_record()
    rng = random.Random(args.seed)
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, max_message_bytes=LIMIT, heartbeat_interval_s=0.2,
                                     worker_liveness_s=1.0, client_liveness_s=2.0),
                        (WorkerConfig(num_slots=4, heartbeat_interval_s=0.2, broker_liveness_s=2.0),),
                        log_level="ERROR")  # one warning per bad frame would drown the counts
    counts = {"frames_frontend": 0, "frames_backend": 0, "multipart": 0, "replies": 0, "checks": 0,
              "hangs": 0, "crashes": 0}
    t0 = time.monotonic()
    with LocalCluster(cfg) as cl, Client(cl.frontend, heartbeat_interval_s=0.2, name="fuzz-probe") as probe:
        ctx = zmq.Context.instance()
        socks = {}
        for side, ep in (("frontend", cl.frontend), ("backend", cl.backend)):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            socks[side] = s
        for n in range(args.frames):
            for side, s in socks.items():
                parts = [frame(rng, side) for _ in range(1 if rng.random() < 0.9 else rng.randrange(2, 4))]
                counts["multipart"] += len(parts) > 1
                s.send_multipart(parts)
                counts[f"frames_{side}"] += 1
                while s.poll(0):
                    s.recv_multipart()
                    counts["replies"] += 1
            if n % args.check_every == 0:
                counts["checks"] += 1
                try:
                    probe.status(timeout_s=5.0)
                except BrokerUnavailable:
                    counts["hangs"] += 1
                if not cl.broker_process.is_alive():
                    counts["crashes"] += 1
                    break
            if n % 20_000 == 0 and n:
                print(f"{n:>9,} frames per socket, {counts['replies']:,} replies, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
        for s in socks.values():
            s.close(0)
        st = probe.status(timeout_s=10.0)
        reqs = [([i + 1, 9], 10) for i in range(200)]
        ref = [tokens for tokens, _ in fault_free([(p, m, {}) for p, m in reqs], batch_size=4)]
        hs = [probe.submit_request(p, m) for p, m in reqs]
        probe.run(timeout=60)
        valid_ok = [h.tokens for h in hs] == ref
        counts["crashes"] += not cl.broker_process.is_alive()
    summary = dict(counts, wall_s=time.monotonic() - t0, bad_messages=st.counters["bad_messages"],
                   internal_errors=st.counters["internal_errors"], valid_traffic_after=valid_ok)
    print()
    for k in ("frames_frontend", "frames_backend", "multipart", "replies", "bad_messages", "internal_errors",
              "checks", "hangs", "crashes", "valid_traffic_after", "wall_s"):
        v = summary[k]
        print(f"{k:<22}{v:>14.1f}" if isinstance(v, float) else f"{k:<22}{v!s:>14}")
    write_results(RESULTS / "fuzz.json", summary, machine)


if __name__ == "__main__":
    main()
