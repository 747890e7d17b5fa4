"""A real S3 endpoint on loopback (moto's server) for the test suite, the demo and the
benchmarks. Not part of the library: moto is a test dependency (``dynstate[test]``).

    with loopback_s3("bucket") as server:   # AWS_* point at it inside the block
        ...
        server.requests                     # every request so far: (method, path, query)

The server is quiet (werkzeug's access log is not printed) and counts requests, so tests can
check how many objects a command read without mocking s3fs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


class LoopbackS3:
    """A moto S3 server on 127.0.0.1 with a request log."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (and subprocesses) here."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def start(self) -> str:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            with self._lock:
                self.requests.append(
                    (environ["REQUEST_METHOD"], environ["PATH_INFO"], environ["QUERY_STRING"])
                )
            return app(environ, start_response)

        class Quiet(MotoRequestHandler):  # type: ignore[misc,valid-type]
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass  # no access log: one line per request floods the demo's terminal

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self._server = make_server("127.0.0.1", port, counting, threaded=True,
                                   request_handler=Quiet)  # fmt: skip
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def create_bucket(self, bucket: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, **_client_kwargs(self.env())).create_bucket(
            Bucket=bucket
        )

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def since(self, mark: int) -> list[tuple[str, str, str]]:
        with self._lock:
            return list(self.requests[mark:])


def _client_kwargs(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


@contextlib.contextmanager
def loopback_s3(bucket: str, *, set_env: bool = True) -> Iterator[LoopbackS3]:
    """A started server holding ``bucket``. With ``set_env`` the AWS_* variables point at it
    inside the block (subprocesses inherit them) and are restored afterwards."""
    try:
        import moto  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            "the loopback S3 server needs moto, which is not installed; "
            "pip install 'dynstate[test]'"
        ) from exc
    logging.getLogger("werkzeug").disabled = True  # tools only: the server's own chatter
    server = LoopbackS3()
    server.start()
    saved = {key: os.environ.get(key) for key in ENV_KEYS}
    try:
        if set_env:
            os.environ.update(server.env())
        server.create_bucket(bucket)
        yield server
    finally:
        server.stop()
        if set_env:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
