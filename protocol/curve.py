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
The broker, workers and clients load their keys with the functions here;
they import pyzmq's ``zmq.auth`` when called (every process that talks
CURVE has pyzmq; importing this module needs only the standard library).
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


def load_key_pair(secret_file: str, who: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` keys (z85) from a ``*.key_secret`` certificate file.

    ``who`` names the owner in errors ("the broker", "the client", ...).
    Raises ValueError when the file is missing, unreadable or holds no secret key.
    """
    from zmq.auth import load_certificate  # (pyzmq: every process that talks CURVE has it)

    try:
        public, secret = load_certificate(secret_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {who}'s CURVE key {secret_file!r}: {e}") from None
    if secret is None:
        raise ValueError(f"{secret_file!r} holds no secret key (use the *.key_secret file)")
    return public, secret


def load_peer_keys(curve: str | os.PathLike | tuple[str, str], role: str) -> tuple[bytes, bytes, bytes]:
    """``(public, secret, broker public)`` keys of a client or worker (``role``).

    ``curve``: a ``slotserve keygen`` directory (its ``ROLE.key_secret`` and
    ``broker.key`` are used) or a ``(secret_key_file, broker_public_key_file)``
    pair. Raises ValueError when it is neither, or a file cannot be read.
    """
    if isinstance(curve, (str, os.PathLike)):
        paths = peer_paths(curve, role)
    elif isinstance(curve, tuple) and len(curve) == 2:
        paths = PeerKeyPaths(*curve)
    else:
        raise ValueError("curve must be a `slotserve keygen` directory or a "
                         f"(secret_key_file, broker_public_key_file) pair, got {curve!r}")
    public, secret = load_key_pair(paths.secret_file, f"the {role}")
    broker_public, _ = _load_public(paths.broker_public_file, role)
    return public, secret, broker_public


def _load_public(public_file: str, role: str) -> tuple[bytes, bytes | None]:
    from zmq.auth import load_certificate

    try:
        return load_certificate(public_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the broker's public CURVE key for the {role} ({public_file!r}): {e}") from None
