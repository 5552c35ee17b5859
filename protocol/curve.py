"""Where CURVE keys live: the directory layout ``slotserve keygen DIR`` writes.

CURVE (ZeroMQ's CurveZMQ: Curve25519 key exchange, encryption and
authentication of every connection; https://rfc.zeromq.org/spec/26/) needs a
key pair per peer. The files are ZeroMQ certificates as written by pyzmq's
``zmq.auth.create_certificates`` (``NAME.key`` public, ``NAME.key_secret``
public + secret). The layout::

    DIR/broker.key  broker.key_secret   the broker's pair (peers need broker.key)
    DIR/client.key  client.key_secret   a client pair
    DIR/worker.key  worker.key_secret   a worker pair
    DIR/clients/*.key                   public keys the frontend admits (clients)
    DIR/workers/*.key                   public keys the backend admits (workers)

Separate allow-lists mean a client key can never register as a worker.
Only paths are computed here (stdlib only); loading keys is the job of the
process that owns the socket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BROKER_NAME = "broker"
CLIENTS_DIR = "clients"
WORKERS_DIR = "workers"


@dataclass(frozen=True, slots=True)
class BrokerKeyPaths:
    """The broker's secret key file and its two allow-list directories."""

    secret_file: str
    clients_dir: str
    workers_dir: str


@dataclass(frozen=True, slots=True)
class PeerKeyPaths:
    """A client's or worker's secret key file and the broker's public key file."""

    secret_file: str
    broker_public_file: str


def broker_paths(curve_dir: str | os.PathLike) -> BrokerKeyPaths:
    """Paths for the broker inside a ``slotserve keygen`` directory."""
    d = os.fspath(curve_dir)
    return BrokerKeyPaths(os.path.join(d, f"{BROKER_NAME}.key_secret"), os.path.join(d, CLIENTS_DIR),
                          os.path.join(d, WORKERS_DIR))


def peer_paths(curve_dir: str | os.PathLike, role: str, name: str | None = None) -> PeerKeyPaths:
    """Paths for a peer (``role`` ``"client"`` or ``"worker"``; key ``name``
    defaults to the role) inside a ``slotserve keygen`` directory.
    Raises ValueError on another role."""
    if role not in ("client", "worker"):
        raise ValueError(f"role must be 'client' or 'worker', got {role!r}")
    d = os.fspath(curve_dir)
    return PeerKeyPaths(os.path.join(d, f"{name or role}.key_secret"), os.path.join(d, f"{BROKER_NAME}.key"))
