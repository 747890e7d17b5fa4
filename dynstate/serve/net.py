"""What ``dynstate serve`` needs before the web stack: which hosts are this machine's loopback
(the Host headers a loopback server answers), the listening socket and its address, and the
check that the ``serve`` extra is installed. Imports only the standard library and click at
module level; the command itself is :mod:`dynstate.cli.commands_serve`."""

from __future__ import annotations

import ipaddress
import logging
import socket

import click

from ..errors import MissingDependencyError

log = logging.getLogger("dynstate")

_NEEDED = ("starlette", "uvicorn", "jinja2")
# Host headers a browser on this machine sends for a loopback server (IPv6 in brackets).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def _bare(host: str) -> str:
    """``[::1]`` as ``::1``: the form a socket binds."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this
    machine's loopback: ``localhost``, 127.0.0.0/8, ``::1`` or an IPv4-mapped 127.x."""
    bare = _bare(host).strip().lower().rstrip(".")
    if bare == "localhost" or bare.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(bare.split("%", 1)[0])  # a zone id (fe80::1%lo) is no help
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def allowed_hosts(host: str) -> list[str] | None:
    """The Host headers a server bound to ``host`` answers, or None (any) off loopback.
    On loopback only this machine's own names may be asked for: a page elsewhere whose
    domain name resolves to 127.0.0.1 (DNS rebinding) is refused, whichever loopback
    address or name was bound."""
    if not is_loopback(host):
        return None
    bare = _bare(host).strip().lower().rstrip(".")
    own = f"[{bare}]" if ":" in bare else bare
    return sorted({*LOOPBACK_NAMES, own})


def require_web_stack() -> None:
    """Raise :class:`MissingDependencyError` unless the ``serve`` extra is installed."""
    missing = []
    for name in _NEEDED:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingDependencyError(
            f"dynstate serve needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; "
            "pip install 'dynstate[serve]'"
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port)."""
    host = _bare(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        import errno

        fix = "choose another --port" if exc.errno == errno.EADDRINUSE else "check --host"
        raise click.ClickException(
            f"cannot listen on {host!r} port {port}: {exc.strerror or exc}; {fix}"
        ) from exc
    sock.listen(128)
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"
