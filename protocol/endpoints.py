"""ZeroMQ TCP endpoints: which address family a socket needs (IPv4, IPv6).

A ZeroMQ socket speaks IPv4 only until its ``IPV6`` option is set; with it,
``tcp://[::1]:5555`` binds and connects, and ``tcp://*:5555`` binds the
addresses of both families (libzmq falls back to IPv4 where the kernel has
no IPv6). For a host name libzmq asks the resolver for one family only and
takes the first address (``ip_resolver.cpp``, ``resolve_getaddrinfo``), so
the option also decides where a name leads. The rule here, the same for
every socket that binds or connects (broker, worker, client):

- an IPv6 literal (``tcp://[::1]:5555``, ``tcp://[fe80::1%eth0]:5555``): IPv6;
- ``*`` when binding: IPv6 as well, which binds both families;
- an IPv4 literal: IPv4, as before;
- a host name: its IPv4 address when it has one (as before IPv6 support,
  so ``tcp://localhost:5555`` keeps meeting a broker bound to
  ``127.0.0.1``), else its IPv6 address; a name that does not resolve (yet)
  or a network interface name keeps the IPv4 default.

Stdlib only: the socket is passed in and its ``ipv6`` attribute set (pyzmq
maps socket attributes to options), so this module does not import zmq.
"""

from __future__ import annotations

import ipaddress
import socket


def endpoint_host(endpoint: str) -> str | None:
    """The host part of a ``tcp://HOST:PORT`` endpoint (brackets kept), or
    None for another transport (``ipc://``, ``inproc://``) or a malformed one.
    A connect endpoint's source address (``tcp://SRC;HOST:PORT``) is skipped."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    address = endpoint[len("tcp://"):].rsplit(";", 1)[-1]
    host, sep, _port = address.rpartition(":")  # the last colon: IPv6 hosts hold colons too
    return host if sep and host else None


def wants_ipv6(endpoint: str, *, bind: bool) -> bool:
    """True when a socket binding (``bind=True``) or connecting to ``endpoint``
    needs ZeroMQ's ``IPV6`` option, by the rule in this module's docstring.
    May consult the system resolver for a host name; never raises."""
    host = endpoint_host(endpoint)
    if host is None:
        return False
    if host.startswith("[") or ":" in host:
        return True
    if host == "*":
        return bind
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        pass  # a host name (or an interface name, when binding)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    families = {info[0] for info in infos}
    return socket.AF_INET not in families and socket.AF_INET6 in families


def set_ipv6(sock, endpoint: str, *, bind: bool) -> None:
    """Set ``sock``'s ZeroMQ ``IPV6`` option for ``endpoint`` (call before
    ``sock.bind(endpoint)`` / ``sock.connect(endpoint)``)."""
    sock.ipv6 = wants_ipv6(endpoint, bind=bind)
