"""The ``serve`` click command. Imports only click (and the CLI's click-only option helpers) at
module level: ``dynstate`` registers it lazily, and without the ``serve`` extra it says how to
install it."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import Any

import click

# The CLI's own --storage-option (one parser, one set of checks); dynstate.cli imports only
# click at module level, so this module stays light.
from ..cli.options import open_store, store_command
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
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port"
        ) from exc
    sock.listen(128)
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("url")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port).")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; the default serves this machine only.")  # fmt: skip
@click.option("--open", "open_browser", is_flag=True, help="Open the store page in a browser.")
@click.option(
    "--checkpoint",
    "checkpoints",
    multiple=True,
    type=click.Path(exists=True),
    help="A verl global_step_N folder or data.pt to show (repeatable).",
)
@store_command
def serve(
    url: str,
    port: int = 8000,
    host: str = "127.0.0.1",
    open_browser: bool = False,
    checkpoints: tuple[str, ...] = (),
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Browse a store in a web browser: versions, rows with filters and search, where each row
    came from and what was derived from it, growth over training steps, diffs and checkpoints.
    Read-only; every page has a JSON twin under /api. Needs `pip install 'dynstate[serve]'`.

    \b
    Example:
      dynstate serve ./runs/run1 --checkpoint ckpt/global_step_40 --open
    """
    require_web_stack()
    import uvicorn

    from .api import StoreView
    from .app import create_app

    options = storage_options or {}
    # The CLI's own opening: a quick reachability check of an explicit S3 endpoint, a missing
    # bucket told apart from a prefix with no store, interactive timeouts.
    store = open_store(url, options)
    view = StoreView(store, checkpoints=checkpoints, url=url, storage_options=options)
    app = create_app(view, allowed_hosts=allowed_hosts(host))
    sock = bind(host, port)
    where = address(sock)
    click.echo(f"serving {store.display_url} (head {store.head}) at {where}/  (Ctrl-C stops)")
    if not is_loopback(host):
        click.echo(
            f"note: listening on {host}: anyone who can reach it can read the store, and any "
            "Host name is answered; the default --host 127.0.0.1 serves this machine only",
            err=True,
        )
    if open_browser:
        import webbrowser

        threading.Timer(0.3, webbrowser.open, args=(f"{where}/",)).start()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
