"""ZeroMQ endpoints: which can work at all (:func:`check_endpoint`), and which
address family a TCP socket needs (IPv4, IPv6).

An endpoint that can never work is refused before any socket sees it:
libzmq itself takes ``tcp://127.0.0.1:99999`` (it keeps the port's low 16
bits, ``ip_resolver.cpp``) and ``tcp://256.1.1.1:5`` (a host name to it,
looked up again on every retry), and a worker or client pointed there would
retry forever. A well-formed endpoint whose broker is not up yet is taken:
the process keeps waiting for it, as it should.

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

An IPv4 literal is what libzmq's resolver takes: it hands the host to the
system's ``getaddrinfo`` (``AI_NUMERICHOST`` when binding), which reads an
IPv4 literal as ``inet_aton`` does, so the shorthand forms work as well as
the dotted quad: ``127.1`` (127.0.0.1), ``10.1.2`` (10.1.0.2), one number
(``2130706433``), hexadecimal parts (``0x7f.1``). Those are taken
(:func:`ipv4_literal`). Two kinds are refused: a dotted number that is no
address (``256.1.1.1``, ``1.2.3.4.5``: libzmq looks it up as a host name on
every retry, and none ever answers), and a part written with a leading zero
(``010.0.0.1``), which the resolver reads as octal (8.0.0.1) where a reader
sees decimal; the error names the address the resolver would have reached,
so the endpoint can be written in dotted decimal. (Python's ``ipaddress``
refuses leading zeros for the same ambiguity, CVE-2021-29921.)

Stdlib only: the socket is passed in and its ``ipv6`` attribute set (pyzmq
maps socket attributes to options), so this module does not import zmq.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket

from protocol.validation import clip, echo

SCHEMES = ("tcp", "ipc")
"""The transports the broker, workers and clients can meet on. ``inproc://`` reaches only sockets
of one ZeroMQ context, and each of them has its own; the others (pgm, tipc, vmci, ws) are for other
socket types or libzmq builds."""

MAX_IPC_PATH_BYTES = 107
"""The longest ``ipc://`` path (bytes): a Unix socket's ``sun_path`` holds 108, its NUL included."""

_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")  # a host name's label (RFC 1123; _ as Docker's names)
_NUMBER = re.compile(r"0[xX][0-9A-Fa-f]*|[0-9]+")  # a part of inet_aton's IPv4 literal: hex, octal or decimal
_OCTAL = re.compile(r"0[0-9]")  # a part inet_aton reads as octal (leading zero)
_EXAMPLE = "tcp://127.0.0.1:5555"


def check_endpoint(endpoint, *, bind: bool, name: str | None = None) -> str:
    """``endpoint`` itself if a socket can bind (``bind=True``) or connect to it; else ValueError
    saying why, after ``name`` (the parameter, when given).

    Taken: ``tcp://HOST:PORT`` with HOST an IPv4 literal (the shorthand forms too, ``127.1``:
    :func:`ipv4_literal`), an IPv6 literal (bracketed or not, a
    zone id allowed), or a host name (RFC 1123 labels, ``_`` allowed; a binding socket's interface
    name, e.g. ``eth0``, has the same form), PORT 1-65535 (binding: 0-65535 or ``*``, any free one;
    HOST ``*`` too, every interface); a connect's source address before a ``;``
    (``tcp://SRC;HOST:PORT``); ``ipc://PATH`` (at most :data:`MAX_IPC_PATH_BYTES` bytes; binding:
    ``ipc://*`` too). Whether a host name resolves is not checked: one may come up later.
    """
    what = f"{name}: " if name else ""
    if not isinstance(endpoint, str):
        raise ValueError(f"{what}a ZeroMQ endpoint is a string like {_EXAMPLE}, got {type(endpoint).__name__}")
    problem = _problem(endpoint, bind=bind)
    if problem:
        raise ValueError(f"{what}{echo(endpoint)} is not a ZeroMQ endpoint that can work: {problem}")
    return endpoint


def _problem(endpoint: str, *, bind: bool) -> str | None:
    """Why ``endpoint`` can never work, or None."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return f"it has no transport (write it like {_EXAMPLE} or ipc:///path/to/socket)"
    if scheme not in SCHEMES:
        if scheme == "inproc":
            return ("inproc:// reaches only sockets in the same ZeroMQ context, and the broker, each worker "
                    "and each client has its own: use tcp:// or ipc://")
        return f"the transport {echo(scheme)} is not one of {', '.join(s + '://' for s in SCHEMES)}"
    if scheme == "ipc":
        if not rest:
            return "ipc:// needs a path (ipc:///path/to/socket)"
        if rest == "*":
            return None if bind else "ipc://* only binds (a fresh path); connect to the path the broker bound"
        if len(rest.encode("utf-8", "surrogatepass")) > MAX_IPC_PATH_BYTES:
            return f"an ipc:// path is at most {MAX_IPC_PATH_BYTES} bytes (a Unix socket's limit)"
        return None
    source, semi, target = rest.rpartition(";")
    if semi:
        if bind:
            return "a source address (SRC;HOST:PORT) is for connecting only"
        problem = _tcp_problem(source, bind=True, port_required=False)
        if problem:
            return f"its source address: {problem}"
    return _tcp_problem(target, bind=bind, port_required=True)


def _tcp_problem(address: str, *, bind: bool, port_required: bool) -> str | None:
    """Why ``HOST:PORT`` (the part after ``tcp://``) can never work, or None."""
    host, sep, port = address.rpartition(":")  # the last colon: IPv6 hosts hold colons too
    no_port = not sep or (not port_required and (address.endswith("]") or (":" in host and host[:1] != "[")))
    if no_port:  # (a source address may have none; an unbracketed IPv6 one then has none)
        host, port = address, None
    if port is None:
        if port_required:
            return f"it needs a port (tcp://HOST:PORT, like {_EXAMPLE})"
    elif port == "*":
        if not bind:
            return "the port * only binds (any free port); connect to the port the broker bound"
    elif not (port.isascii() and port.isdigit()):
        return f"the port {echo(port)} is not a number"
    elif int(port) > 65535:
        return f"the port {int(port)} is beyond 65535"
    elif int(port) == 0 and not bind:
        return "the port 0 only binds (any free port); connect to the port the broker bound"
    return _host_problem(host, bind=bind)


def _host_problem(host: str, *, bind: bool) -> str | None:
    """Why ``host`` (an endpoint's host part, brackets kept) can never be bound or reached, or None."""
    if not host:
        return f"it has no host (tcp://HOST:PORT, like {_EXAMPLE})"
    if host == "*":
        return None if bind else "the host * only binds (every interface); connect to the broker's host"
    if host.startswith("[") or ":" in host:
        literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            return f"the host {echo(host)} is not an IPv6 address"
        return None
    address = ipv4_literal(host)
    if address is not None:
        if any(_OCTAL.match(part) for part in host.split(".")):
            return (f"the host {echo(host)} has a part with a leading 0, which the system's resolver reads as "
                    f"octal: it means {address}; write that (or the decimal address meant) without leading zeros")
        return None
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if all(label.isascii() and label.isdigit() for label in labels):  # a dotted number, but no address
        return (f"the host {echo(host)} is not an IPv4 address (four numbers 0-255 like 127.0.0.1, "
                "or a shorthand like 127.1)")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return f"the host {echo(host)} is neither an IP address nor a host name"
    if labels[-1].isdigit():
        return f"the host {echo(host)} is neither an IP address nor a host name (its last label is a number)"
    return None


def ipv4_literal(host: str) -> str | None:
    """The dotted quad (``"127.0.0.1"``) that the system's resolver, and so libzmq, reads ``host``
    as when it is an IPv4 literal in any of ``inet_aton``'s forms (``127.1``, ``10.1.2``,
    ``2130706433``, ``0x7f.1``, ``0177.0.0.1``); None for anything else (a host name, an IPv6
    literal, a dotted number out of range such as ``256.1.1.1``). Never raises."""
    if not isinstance(host, str) or not all(_NUMBER.fullmatch(part) for part in host.split(".")):
        return None  # (inet_aton also skips trailing blanks and text after them; getaddrinfo does not)
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


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
    if ipv4_literal(host) is not None:
        return False
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


class BindError(OSError):
    """An address a slotserve process listens on (the broker's endpoints, its metrics port, the
    HTTP server's port) could not be bound. ``str()`` is one line for a person: what listens, the
    address, the system's reason and what to do; ``errno`` is the system's code (None when unknown).
    Made by :func:`bind_error`."""


def bind_error(what: str, address: str, code: int | None, reason: str) -> BindError:
    """The :class:`BindError` for binding ``address`` (``tcp://127.0.0.1:5555``, ``127.0.0.1:8000``)
    for ``what`` (``"the broker's client endpoint (--frontend)"``), which failed with the system's
    ``code`` (an ``errno`` value; ZeroMQ uses the same) and ``reason`` (its words, used where
    ``code`` is no errno value, as getaddrinfo's codes are; a known code is said as ``os.strerror``
    says it, without what pyzmq and ``socket.create_server`` add to it)."""
    if code in errno.errorcode:
        reason = os.strerror(code)
    hint = {
        errno.EADDRINUSE: "another process listens there (another slotserve up, broker or serve?): "
                          "stop it, or choose another port",
        errno.EADDRNOTAVAIL: "that host is not an address of this machine: bind one it has (127.0.0.1, or 0.0.0.0 "
                             "for every interface)",
        errno.EACCES: "this user may not listen there (ports below 1024 need privileges): choose a port above 1023",
    }.get(code)
    e = BindError(f"{what} cannot listen on {clip(address)}: {reason}" + (f"; {hint}" if hint else ""))
    e.errno = code
    return e
