"""The obstore backend for s3:// (dynstate/storage/s3obstore.py; s3fs only where
DYNSTATE_S3_CLIENT=s3fs or the configuration is one only s3fs reads) on the loopback S3
server: its reads, ranges, listings and stats
against s3fs's view of the same objects (the oracle), the exclusive create, and its failures
as dynstate's error types with no credential in a message."""

from __future__ import annotations

import pickle
import random
import threading

import pytest
from conftest import S3_BUCKET, s3_url

from dynstate.errors import StorageError, StoreNotFoundError
from dynstate.storage import open_storage

pytest.importorskip("obstore")

from dynstate.storage.s3obstore import ObstoreStorage


@pytest.fixture
def obstore_env(monkeypatch, s3_endpoint):
    monkeypatch.delenv("DYNSTATE_S3_CLIENT", raising=False)
    return s3_endpoint


def _storage(url: str | None = None, **options) -> ObstoreStorage:
    storage = open_storage(url or s3_url(), options)
    assert isinstance(storage, ObstoreStorage) and storage.served
    storage.retry_base_s = 0.001
    return storage


def _s3fs(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


def test_reads_ranges_and_listings_match_s3fs(obstore_env):
    storage = _storage()
    rng = random.Random(7)
    blobs = {
        "a/x.bin": rng.randbytes(1000),
        "a/y.bin": rng.randbytes(17),
        "a/b/z.bin": b"",
        "c.json": b"{}",
    }
    for rel, data in blobs.items():
        storage.create(rel, data)
    fs = _s3fs(obstore_env)
    for rel, data in blobs.items():
        assert fs.cat_file(storage.path(rel)) == data  # written as given
        assert storage.read(rel) == data
        assert storage.size(rel) == len(data)
        assert storage.exists(rel)
        info = fs.info(storage.path(rel))
        assert storage.modified(rel) == info["LastModified"].timestamp()
    # unsorted, repeated, empty, past the end and reaching over it
    ranges = [
        ("a/x.bin", 900, 1000),
        ("a/x.bin", 0, 10),
        ("a/y.bin", 3, 9),
        ("a/x.bin", 0, 10),
        ("a/x.bin", 5, 5),
        ("a/y.bin", 10, 40),
        ("a/y.bin", 17, 30),
        ("a/x.bin", 999, 1000),
    ]
    got = storage.read_ranges(ranges)
    assert got == [blobs[rel][start:end] for rel, start, end in ranges]
    assert storage.read_many(["a/y.bin", "nope", "a/y.bin"]) == [
        blobs["a/y.bin"],
        None,
        blobs["a/y.bin"],
    ]
    for rel_dir in ("", "a", "a/b", "missing"):
        path = storage.path(rel_dir) if rel_dir else storage.root
        expected = (
            sorted(e.rsplit("/", 1)[-1] for e in fs.ls(path, detail=False, refresh=True))
            if fs.exists(path)
            else []
        )
        assert storage.list(rel_dir) == expected, rel_dir
    assert storage.list("a") == ["b", "x.bin", "y.bin"]


def test_missing_objects_and_buckets(obstore_env):
    storage = _storage()
    with pytest.raises(FileNotFoundError):
        storage.read("nothing/here")
    assert storage.try_read("nothing/here") is None
    assert not storage.exists("nothing/here")
    assert storage.list("nothing") == []
    storage.delete("nothing/here")  # a missing object is deleted already
    gone = _storage("s3://no-such-bucket-dynstate/run")
    with pytest.raises(StoreNotFoundError, match="no-such-bucket-dynstate"):
        gone.read("x")
    with pytest.raises(StoreNotFoundError, match="bucket"):
        gone.list("")


def test_exclusive_create_has_one_winner(obstore_env):
    storage = _storage()
    assert storage.check_exclusive_create() is True
    storage.create("rec.json", b"first")
    with pytest.raises(FileExistsError):
        storage.create("rec.json", b"second")
    assert storage.read("rec.json") == b"first"
    # the same bytes read back as our own earlier attempt; other bytes lost the race
    assert storage.create_if_absent("rec.json", b"first") is True
    assert storage.create_if_absent("rec.json", b"other") is False
    storage.put("rec.json", b"replaced")
    assert storage.read("rec.json") == b"replaced"
    storage.delete("rec.json")
    assert not storage.exists("rec.json")

    wins: list[int] = []
    lost: list[int] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        try:
            storage.create("race.json", f"writer {i}".encode())
            wins.append(i)
        except FileExistsError:
            lost.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(lost) == 7
    assert storage.read("race.json") == f"writer {wins[0]}".encode()


@pytest.fixture
def refusing_endpoint():
    """An HTTP endpoint that refuses every request as S3 does a bad signature, quoting back
    what it was sent (moto checks no signatures; a careless proxy may echo headers)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            body = (
                "<?xml version='1.0'?><Error><Code>SignatureDoesNotMatch</Code><Message>"
                f"bad signature for {self.headers.get('Authorization')}</Message></Error>"
            ).encode()
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_DELETE = _refuse

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_refused_credentials_name_the_url_not_the_secret(obstore_env, refusing_endpoint):
    key, secret = "AKIDDYNSTATETEST0002", "WRONG-secret/value+0123456789"
    storage = _storage(key=key, secret=secret, endpoint_url=refusing_endpoint)
    for attempt in (lambda: storage.read("x"), lambda: storage.create("y", b"1")):
        with pytest.raises(StorageError, match="refused the credentials") as info:
            attempt()
        message = str(info.value)
        assert f"s3://{S3_BUCKET}/" in message and "SignatureDoesNotMatch" in message
        assert key not in message and secret not in message and "WRONG-secret" not in message


def test_unreachable_endpoint_is_a_storage_error(obstore_env):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    storage = _storage(
        endpoint_url=f"http://127.0.0.1:{port}", config_kwargs={"retries": {"max_attempts": 0}}
    )
    storage.retry_attempts = 2
    with pytest.raises(StorageError, match="cannot reach the endpoint") as info:
        storage.read("x")
    assert "after 2 attempts" in str(info.value)


def test_served_only_where_the_configuration_is_known(obstore_env, monkeypatch):
    assert _storage().served
    monkeypatch.setenv("AWS_PROFILE", "someone")
    assert not open_storage(s3_url(), {}).served  # a profile: s3fs finds its credentials
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-from-the-environment")
    explicit = open_storage(s3_url(), {"key": "testing", "secret": "testing"})
    assert not explicit.served  # obstore would add the environment's token to explicit keys
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    monkeypatch.setenv("DYNSTATE_S3_CLIENT", "s3fs")
    assert not open_storage(s3_url(), {}).served


def test_a_pickled_storage_reads_in_another_process_state(obstore_env):
    storage = _storage()
    storage.create("p.bin", b"payload")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.read("p.bin") == b"payload"
    assert clone.read_ranges([("p.bin", 1, 4), ("p.bin", 0, 2)]) == [b"ayl", b"pa"]


def test_a_child_forked_after_obstore_ran_reads_and_writes(obstore_env):
    """obstore's runtime does not survive a fork (a DataLoader worker's): the child reads
    and writes through s3fs, and its parent goes on with obstore."""
    import os
    import signal

    storage = _storage()
    storage.create("before.bin", b"parent")
    assert storage.read_ranges([("before.bin", 0, 2), ("before.bin", 2, 6)]) == [b"pa", b"rent"]
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if everything held, killed if it hangs
        signal.alarm(30)
        ok = False
        try:
            ok = (
                not storage.served
                and storage.read("before.bin") == b"parent"
                and storage.read_ranges([("before.bin", 1, 3)]) == [b"ar"]
                and storage.create_if_absent("child.bin", b"child")
                and storage.list("") == ["before.bin", "child.bin"]
            )
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert storage.served and storage.read("child.bin") == b"child"
