"""``dynstate serve``: the click command that starts the web view (:mod:`dynstate.serve`).
Imports only click at module level, like every command: the web stack (the ``serve`` extra)
is imported when the command runs, and without it the command says how to install it."""

from __future__ import annotations

import threading
from typing import Any

import click

from .options import open_store, store_command


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
    from ..serve.net import address, allowed_hosts, bind, is_loopback, require_web_stack

    if not host.strip():
        raise click.BadParameter(
            "an empty host would listen on every interface; write 0.0.0.0 for that, "
            "or leave --host out for this machine only",
            param_hint="--host",
        )

    require_web_stack()
    import uvicorn

    from ..serve.api import StoreView
    from ..serve.app import create_app

    options = storage_options or {}
    # The CLI's own opening: a quick reachability check of an explicit S3 endpoint, a missing
    # bucket told apart from a prefix with no store, interactive timeouts.
    store = open_store(url, options)
    view = StoreView(store, checkpoints=checkpoints, url=url, storage_options=options)
    app = create_app(view, allowed_hosts=allowed_hosts(host))
    from .errors import Failure

    try:
        sock = bind(host, port)
    except click.ClickException as exc:
        raise Failure(exc.message) from None
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


COMMANDS = [serve]
