"""The web view on a real uvicorn server on 127.0.0.1, in a thread: what the serve tests
request pages from (the one harness they share)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dynstate.serve.api import StoreView
from dynstate.serve.app import create_app
from dynstate.serve.net import address, bind


@contextmanager
def served(view: StoreView, *, log_level: str = "warning", **app_options: Any) -> Iterator[str]:
    """The base URL of ``create_app(view, **app_options)`` served until the block ends."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    app = create_app(view, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield address(sock)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
