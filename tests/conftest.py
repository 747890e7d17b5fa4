"""Shared fixtures: one parametrized store location over every backend (memory://, a local
directory, s3:// on a loopback moto server), so store tests run as one contract."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The loopback S3 server lives with the tools (the demo and benchmarks use it too), outside the
# library package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

S3_BUCKET = "dynstate-test"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3 endpoint on loopback (moto's server, tools/loopback_s3.py) that logs every
    request. Its address goes into the standard AWS environment variables, so subprocesses and
    s3fs find it like any S3 endpoint."""
    from loopback_s3 import loopback_s3

    with loopback_s3(S3_BUCKET) as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: Any) -> str:
    return s3_server.endpoint


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
