"""Shared fixtures: one parametrized store location over every backend (memory://, a local
directory, s3:// on a loopback moto server), so store tests run as one contract."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

S3_BUCKET = "dynstate-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 endpoint on loopback (moto's server). Its address goes into the standard
    AWS environment variables, so subprocesses and s3fs find it like any S3 endpoint."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=S3_BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def s3_url(name: str = "") -> str:
    return f"s3://{S3_BUCKET}/{name or uuid.uuid4().hex}"


@pytest.fixture(params=["memory", "local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty store location on each backend."""
    if request.param == "memory":
        return f"memory://dynstate-tests/{uuid.uuid4().hex}"
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_endpoint")
    return s3_url()


@pytest.fixture(params=["local", "s3"])
def durable_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A store location that other processes can reach (for multi-process and kill tests)."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_endpoint")
    return s3_url()
