"""Crash soak for the store: a writer process appends in a loop and is SIGKILLed at random
instants; after each kill the store must open, every committed version must read back with
matching checksums, and the head must hold exactly the rounds whose commit completed.

    python tools/soak_store.py --trials 200          # local directory
    python tools/soak_store.py --trials 50 --s3      # a loopback S3 server (moto)
    python tools/soak_store.py --trials 100 --gc     # with gc at grace 0 running all along
    python tools/soak_store.py --trials 50 --big-every 3   # every 3rd round ~2.5 MB, one shard

With ``--gc``, a gc thread collects garbage at grace 0 in a tight loop while each writer runs
(it must never remove what a commit names or is about to name), and after each kill a last
gc must leave no uncommitted shard behind (the killed writer's lease ends with its process).
With ``--big-every N`` every Nth round is one shard of ~2.5 MB of Parquet: past the shard
sink's 1 MiB, so it is hashed and written on the sink's writer thread, and the kills land
inside that too.

``tests/test_store_crash.py`` runs a short share of the same trials (it imports this module).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Small shards, so that a kill can land between the shards of one round.
SHARD_BYTES = 512
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")
# A big round: 36,000 rows of hex digests (Parquet cannot shrink them), ~2.5 MB in one shard:
# past the shard sink's 1 MiB, the rest goes through its writer thread.
BIG_ROWS = 36_000
BIG_SHARD_BYTES = 64 << 20
_BIG_EVERY = "DYNSTATE_SOAK_BIG_EVERY"  # how the writer process learns it
_BIG_CACHE: dict[int, list[dict[str, Any]]] = {}


def is_big(k: int, big_every: int) -> bool:
    return big_every > 0 and k % big_every == big_every - 1


def round_rows(k: int, big_every: int = 0) -> list[dict[str, Any]]:
    """Round ``k``'s rows, a pure function of k: some rounds are empty, some span shards,
    and with ``big_every`` every that-many-th round is big (see BIG_ROWS)."""
    if is_big(k, big_every):
        if k not in _BIG_CACHE:  # the checker compares every round after every kill
            _BIG_CACHE[k] = [
                {"round": k, "i": i, "text": hashlib.sha256(b"%d,%d" % (k, i)).hexdigest()}
                for i in range(BIG_ROWS)
            ]
        return _BIG_CACHE[k]
    n = (k * 37) % 11 * 6
    return [{"round": k, "i": i, "text": f"round {k} row {i} " + "x" * (i % 13)} for i in range(n)]


def shard_bytes_of(k: int, big_every: int) -> int:
    return BIG_SHARD_BYTES if is_big(k, big_every) else SHARD_BYTES


def writer_main(url: str, log_file: str, env: dict[str, str]) -> None:
    """Append rounds forever, logging "begin k" before and "commit v k" after each append.

    A kill between the commit and its log line leaves one version the log does not know; the
    checker accepts exactly that one (the round whose begin has no commit line)."""
    os.environ.update(env)
    from dynstate import Store

    big_every = int(os.environ.get(_BIG_EVERY, "0"))
    fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())  # unbuffered: in the file once write() returns

    store = Store.open(url)
    head = store.commit_record(store.head)
    k = int(head.meta.get("round", -1)) + 1  # carry on after what the last writer committed
    note("ready")
    while True:
        note(f"begin {k}")
        rows, shard_bytes = round_rows(k, big_every), shard_bytes_of(k, big_every)
        version = store.append(rows, meta={"round": k}, shard_bytes=shard_bytes)
        note(f"commit {version} {k}")
        k += 1


def die_at(url: str, point: str, env: dict[str, str]) -> None:
    """Append the next round but SIGKILL this process at a chosen point of the commit:
    ``before-commit`` (shards written, no record), ``after-commit`` (record created, head hint
    not yet updated) or ``checkpoint`` (record created, checkpoint not yet written)."""
    os.environ.update(env)
    from dynstate import Store
    from dynstate.records import manifest as m
    from dynstate.storage import Storage

    prefix = {
        "before-commit": f"{m.META_DIR}/log/",
        "after-commit": m.HEAD_HINT,
        "checkpoint": f"{m.META_DIR}/checkpoints/",
    }[point]
    create, put = Storage.create, Storage.put

    def dying(original: Any) -> Any:
        def write(self: Storage, rel: str, data: bytes, **kwargs: Any) -> None:
            if rel.startswith(prefix):
                os.kill(os.getpid(), signal.SIGKILL)
            original(self, rel, data, **kwargs)

        return write

    Storage.create, Storage.put = dying(create), dying(put)  # type: ignore[method-assign]
    # The head hint is written by overwrite(), which backends define for themselves.
    classes = [Storage]
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if "overwrite" in cls.__dict__:
            cls.overwrite = dying(cls.__dict__["overwrite"])  # type: ignore[method-assign]
    store = Store.open(url)
    k = int(store.commit_record(store.head).meta.get("round", -1)) + 1
    store.append(round_rows(k), meta={"round": k}, shard_bytes=SHARD_BYTES)


class TrialFailure(AssertionError):
    pass


@dataclass
class Outcome:
    """What one trial saw, for the summary."""

    head: int
    new_versions: int
    unlogged_commit: bool
    stray_shards: int
    killed_before_ready: bool
    killed_in_round: int | None = None  # the round begun and not logged as committed


@dataclass
class Soak:
    """A store and the writers that crash into it, trial after trial."""

    url: str
    workdir: Path
    max_delay: float = 0.3
    rng: random.Random = field(default_factory=random.Random)
    env: dict[str, str] = field(default_factory=dict)
    trials: int = 0
    full_every: int = 10
    gc: bool = False  # run gc at grace 0 against the writers
    # The share of trials that wait for the writer's first commit before the random delay:
    # on a loaded machine a writer racing gc may not commit within max_delay of "ready", and
    # a run of trials that all kill before any commit would prove nothing.
    commit_first: float = 0.0
    big_every: int = 0  # every that-many-th round is big (round_rows)
    rows_of: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from dynstate import Store

        Store.open(self.url, create=True)
        self.env = {k: os.environ[k] for k in _ENV if k in os.environ}
        self.env[_BIG_EVERY] = str(self.big_every)
        self.verified_head = 0  # versions up to here were checked by an earlier trial

    def trial(self) -> Outcome:
        """Start a writer, kill it at a random instant, check the store."""
        self.trials += 1
        log_file = self.workdir / f"writer-{self.trials}.log"
        ctx = _context()
        import soak_store  # by module name, also when this file runs as __main__

        proc = ctx.Process(target=soak_store.writer_main, args=(self.url, str(log_file), self.env))
        proc.start()
        stop, gc_errors = threading.Event(), []
        gc_thread = threading.Thread(target=self._gc_loop, args=(stop, gc_errors), daemon=True)
        if self.gc:
            gc_thread.start()
        early = self.rng.random() < 0.1
        if early:
            time.sleep(self.rng.uniform(0, 0.05))  # perhaps while it is still opening
        else:
            deadline = time.monotonic() + 60
            wanted = "commit " if self.rng.random() < self.commit_first else "ready"
            while wanted not in _read(log_file):
                if time.monotonic() > deadline or not proc.is_alive():
                    proc.kill()
                    raise TrialFailure(f"writer never became ready (exit {proc.exitcode})")
                time.sleep(0.002)
            time.sleep(self.rng.uniform(0, self.max_delay))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        stop.set()
        if self.gc:
            gc_thread.join()
        if gc_errors:
            raise TrialFailure(f"gc failed while the writer ran: {gc_errors[0]!r}")
        if proc.exitcode != -signal.SIGKILL:
            raise TrialFailure(f"writer ended with {proc.exitcode} before the kill")
        outcome = self.check(_read(log_file), early)
        if self.gc:
            from dynstate import Store, collect_garbage

            store = Store.open(self.url)
            collect_garbage(store, grace_s=0, dry_run=False)
            referenced = {
                s.path for r in store.versions() for s in store.snapshot(r.version).shards
            }
            stray = [n for n in store.storage.list("data") if f"data/{n}" not in referenced]
            if stray:
                raise TrialFailure(f"gc left {len(stray)} uncommitted shards of a dead writer")
        return outcome

    def _gc_loop(self, stop: threading.Event, errors: list[BaseException]) -> None:
        from dynstate import Store, collect_garbage

        store = Store.open(self.url)
        while not stop.is_set():
            try:
                collect_garbage(store, grace_s=0, dry_run=False)
            except Exception as exc:
                errors.append(exc)
                return

    def check(self, log_text: str, early: bool) -> Outcome:
        from dynstate import Store

        store = Store.open(self.url)  # must open whatever the instant of the kill
        head = store.head
        begun: list[int] = []
        logged: dict[int, int] = {}  # version -> round
        for line in log_text.splitlines():
            parts = line.split()
            if parts[:1] == ["begin"] and len(parts) == 2:
                begun.append(int(parts[1]))
            elif parts[:1] == ["commit"] and len(parts) == 3:
                logged[int(parts[1])] = int(parts[2])
        pending = [k for k in begun if k not in logged.values()]
        last_logged = max(logged, default=self.verified_head)
        unlogged = head == last_logged + 1
        if not (head == last_logged or unlogged):
            raise TrialFailure(f"head is {head}, but the writer last logged {last_logged}")
        if unlogged:
            if len(pending) != 1 or store.commit_record(head).meta.get("round") != pending[0]:
                raise TrialFailure(f"version {head} is not the round in flight {pending}")
            logged[head] = pending[0]

        records = store.versions()
        if [r.version for r in records] != list(range(head + 1)):
            raise TrialFailure(f"versions have gaps: {[r.version for r in records]}")
        for version, k in logged.items():
            if records[version].meta.get("round") != k:
                raise TrialFailure(f"version {version} holds {records[version].meta}, not {k}")
        # Rounds are committed one after the other: version v holds round (its parent's) + 1.
        rounds = [r.meta["round"] for r in records[1:]]
        if rounds != list(range(len(rounds))):
            raise TrialFailure(f"rounds are not each committed once, in order: {rounds}")

        # The head holds exactly the committed rounds, every shard matching its checksum.
        # Shards are immutable, so each is read (and verified) once, and the whole head again
        # every ``full_every`` trials and at the end.
        snap = store.snapshot(head)
        if self.trials % self.full_every == 0:
            self.rows_of.clear()
        for shard in snap.shards:
            if shard.path not in self.rows_of:
                self.rows_of[shard.path] = store.read_shard(shard, snap.schema).to_pylist()
        got = [row for shard in snap.shards for row in self.rows_of[shard.path]]
        if got != [row for k in rounds for row in round_rows(k, self.big_every)]:
            raise TrialFailure(f"head {head} does not hold exactly the committed rounds")
        # Each new version is a prefix of the head (row identity) and reads back.
        for version in range(self.verified_head + 1, head + 1):
            part = store.snapshot(version)
            if list(part.shards) != list(snap.shards[: len(part.shards)]):
                raise TrialFailure(f"version {version} is not a prefix of the head")
            if part.commit.num_rows != part.num_rows:
                raise TrialFailure(f"version {version} lists {part.num_rows} rows")
        referenced = {s.path.rsplit("/", 1)[-1] for s in snap.shards}
        stray = [n for n in store.storage.list("data") if n not in referenced]
        new = head - self.verified_head
        self.verified_head = head
        return Outcome(head, new, unlogged, len(stray), early, pending[0] if pending else None)

    def final_check(self, samples: int = 10) -> None:
        """Every version of the store checked by a fresh reader: the head read back in full
        (every shard against its checksum), every version a prefix of it with the rows its
        record states, and a sample of versions read back in full on their own."""
        from dynstate import Store

        store = Store.open(self.url)
        head = store.snapshot()
        table = head.to_arrow()
        for record in store.versions():
            snap = store.snapshot(record.version)
            if list(snap.shards) != list(head.shards[: len(snap.shards)]):
                raise TrialFailure(f"version {record.version} is not a prefix of the head")
            if snap.num_rows != record.num_rows:
                raise TrialFailure(f"version {record.version} lists {snap.num_rows} rows")
        for version in self.rng.sample(range(head.version + 1), min(samples, head.version + 1)):
            snap = store.snapshot(version)
            got = snap.to_arrow().to_pylist() if snap.num_rows else []
            if got != (table.slice(0, snap.num_rows).to_pylist() if snap.num_rows else []):
                raise TrialFailure(f"version {version} does not read back as a head prefix")


_CTX: Any = None


def _context() -> Any:
    """A forkserver with dynstate preloaded: each writer starts in milliseconds, from a clean
    single-threaded parent (not a fork of pytest or the S3 server threads)."""
    global _CTX
    if _CTX is None:
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        _CTX = mp.get_context("forkserver")
        # pyarrow imports pandas lazily on the first from_pylist: preload it too.
        _CTX.set_forkserver_preload(["soak_store", "dynstate", "pyarrow.parquet", "pandas", "s3fs"])
    return _CTX


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _moto() -> Any:
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="soak",
        AWS_SECRET_ACCESS_KEY="soak",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket="dynstate-soak")
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--s3", action="store_true", help="use a loopback moto S3 server")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--max-delay", type=float, default=0.5, help="seconds, per trial")
    parser.add_argument("--gc", action="store_true", help="run gc at grace 0 all along")
    parser.add_argument("--big-every", type=int, default=0, help="every Nth round ~2.5 MB")
    args = parser.parse_args(argv)
    server = _moto() if args.s3 else None
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dynstate-soak-") as tmp:
        url = "s3://dynstate-soak/store" if args.s3 else os.path.join(tmp, "store")
        soak = Soak(
            url,
            Path(tmp),
            max_delay=args.max_delay,
            rng=random.Random(args.seed),
            gc=args.gc,
            big_every=args.big_every,
        )
        outcomes: list[Outcome] = []
        try:
            for n in range(args.trials):
                outcomes.append(soak.trial())
                if (n + 1) % 20 == 0:
                    print(f"{n + 1} trials, head {outcomes[-1].head}", flush=True)
            soak.final_check()
        except TrialFailure as exc:
            print(f"FAILED at trial {soak.trials} (seed {args.seed}): {exc}", file=sys.stderr)
            return 1
        finally:
            if server is not None:
                server.stop()
    print(
        f"{len(outcomes)} kills on {'s3' if args.s3 else 'local'} (seed {args.seed}) in "
        f"{time.monotonic() - start:.0f}s: all passed; head {outcomes[-1].head}, "
        f"{sum(o.unlogged_commit for o in outcomes)} kills between a commit and its log line, "
        f"{sum(o.killed_before_ready for o in outcomes)} while opening, "
        f"{sum(o.new_versions == 0 for o in outcomes)} with no new version, "
        f"{outcomes[-1].stray_shards} uncommitted shards left for gc"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
