"""Shared fixtures: one parametrized store location over every backend (memory://, a local
directory, s3:// on a loopback moto server), so store tests run as one contract; and the order
in which pytest-xdist's workers take the modules."""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (tools/test.sh: ``-n 2 --dist loadfile --no-loadscope-reorder``) a
    worker runs a module whole, so module-scoped fixtures (verl's zygote and reference runs,
    Chromium, Ray) are built once, as in a serial run, and tests/test_verl_v1.py's drivers run
    one at a time. The modules with the most ``slow`` test functions (parameters not counted:
    a sweep of short trials is not a long test) go first, so the longest ones start at once
    instead of ending the run on one worker. A serial run keeps pytest's order.

    Every case that reaches the loopback S3 server is marked ``s3`` here, so that
    ``-m "not s3"`` deselects all of them: those asking for its fixtures, directly or
    through a backend parameter (``store_url``/``durable_url`` = "s3", or any parameter
    named so)."""
    for item in items:
        if _needs_s3(item) and item.get_closest_marker("s3") is None:
            item.add_marker(pytest.mark.s3)
    if getattr(config, "workerinput", None) is None:
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def slow_functions(module: list[pytest.Item]) -> int:
        return len(
            {getattr(i, "originalname", i.name) for i in module if i.get_closest_marker("slow")}
        )

    ordered = sorted(modules.values(), key=lambda m: -slow_functions(m))  # stable on ties
    items[:] = [item for module in ordered for item in module]


_S3_FIXTURES = frozenset({"s3_server", "s3_endpoint"})


def _needs_s3(item: pytest.Item) -> bool:
    if _S3_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    return any(isinstance(v, str) and v == "s3" for v in callspec.params.values())


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


@pytest.fixture
def decode_what_this_process_wrote() -> Iterator[None]:
    """For the modules that hold the decode paths (row groups, footers, a flipped byte found,
    a missing shard named): they read back shards they wrote, which would otherwise come from
    the fresh round's kept tables (:mod:`dynstate.fresh`, on by default) without a decode.
    Those tests ask for it (``usefixtures``); the rest of the suite runs with the default."""
    from dynstate import fresh

    bound = fresh.FRESH.max_bytes
    fresh.FRESH.max_bytes = 0
    fresh.FRESH.clear()
    yield
    fresh.FRESH.max_bytes = bound


@pytest.fixture
def no_decoded_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of the decode paths themselves (row groups read in part, pieces of one
    decode): a second dataset over a local store would otherwise map the shards the first
    decoded whole (:class:`dynstate.loading.cache.Decoded`, on by default) and decode
    nothing. The damage tests keep the default: a shard changed on disk is found either way."""
    monkeypatch.setenv("DYNSTATE_DECODED_CACHE", "0")


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
