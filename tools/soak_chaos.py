"""Everything-at-once chaos soak (issue 19): nothing acknowledged is ever lost.

Against one store, all at the same time:

- appender processes (``append`` in a loop; every other round with outcomes on rows of the
  head and a generator state, issue 21),
- stager processes that stage a round and hand the pickled part to a committer process,
  then exit at once (or are killed right after their own lease renewal),
- committer processes that unpickle those parts (taking the leases over) and commit them
  (every third with outcomes, through ``commit_staged(..., outcomes=)``),
- a compactor and a resetter (``reset`` to a recent version, as a resumed run does; it
  holds off while a compaction runs, or no compaction of a large head would ever land),
- gc at grace 0 in a tight loop, in a process whose clock is shifted by hours (``time.time``
  and ``datetime.now`` monkeypatched before dynstate is imported; the library has no hook for
  it: gc must judge every age by the storage's clock),
- a loader: a ``StatefulDataLoader`` over ``VersionedDataset`` reading batches of
  version-tagged indices (unsorted, repeated, of recent versions) with ``row_column``, in a
  format drawn, its cache warm or fresh; every batch it hands out is checked against the
  oracle, the version's shards (its manifest's list) read whole with pyarrow (on S3 from
  the server directly, not through the faults) and ``take``,
- random SIGKILLs of every kind of worker (the soak starts a fresh one in its place), and
  SIGSTOP pauses of writers,
- on S3: a loopback moto server behind the fault proxy of ``tests/s3_faults.py`` (dropped
  requests and replies, 500/503, delays, cut bodies).

Every worker logs each version ``append`` / ``commit_staged`` / ``reset`` / ``compact``
returned (the acknowledgement) to its own log file, unbuffered, before anything else. An
auditor thread reads each acknowledged version back (all rows, checksums checked; a round's
outcome files hold exactly the outcomes it sent, its outcome lineage is its parent's plus
those, a reset's and a compaction's that of their source, the generator state is the one
committed last; every 25th version (more sparsely once a lineage is long: ``stats_due``)
and the head, the statistics equal the raw records') right after its ack, and at the end
every acknowledged version is read again. Exit status 1 on any acknowledged version that is
lost or unreadable (unless gc's retention collected it, which this soak never asks for: it
runs gc without ``keep``) and on any batch the loader handed out that is not the oracle's
rows, 0 otherwise.

    python tools/soak_chaos.py --seconds 600               # local directory
    python tools/soak_chaos.py --seconds 600 --s3          # loopback S3 with faults
    python tools/soak_chaos.py --seconds 20 --skew 7200    # gc's clock 2 h ahead

``tests/test_clock_skew.py`` runs a short share (about 20 s, local).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARD_BYTES = 700
LEASE_TTL_S = 2.0  # short, so that gc's lease judgements happen many times a minute
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def shift_clock(offset_s: float) -> None:
    """Shift this process's wall clock by ``offset_s`` seconds, as a host whose clock is off:
    ``time.time``, ``time.time_ns`` and ``datetime.datetime.now`` / ``utcnow`` / ``today``.
    Modules that call ``time.time()`` or ``datetime.datetime.now()`` see the shift; dynstate's
    modules that imported ``datetime`` by name (before this call, in a forked worker) are
    pointed at the shifted class too. The monotonic clock stays: it measures no wall time.

    Compiled modules that embed the datetime type (numpy, pandas, pyarrow) are imported
    first, with the real class, so that they load."""
    import datetime as dt
    import warnings

    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow
    import pyarrow.dataset
    import pyarrow.parquet  # noqa: F401

    try:
        import s3fs  # noqa: F401
    except ImportError:
        pass
    warnings.filterwarnings("ignore", "datetime.datetime size changed")
    real_time, real_time_ns = time.time, time.time_ns
    base = dt.datetime

    def shifted_time() -> float:
        return real_time() + offset_s

    def shifted_time_ns() -> int:
        return real_time_ns() + int(offset_s * 1e9)

    class ShiftedDatetime(base):  # type: ignore[misc, valid-type]
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return base.fromtimestamp(shifted_time(), tz)

        @classmethod
        def utcnow(cls) -> Any:
            return base.fromtimestamp(shifted_time(), dt.timezone.utc).replace(tzinfo=None)

        @classmethod
        def today(cls) -> Any:
            return base.fromtimestamp(shifted_time())

    time.time = shifted_time  # type: ignore[assignment]
    time.time_ns = shifted_time_ns  # type: ignore[assignment]
    dt.datetime = ShiftedDatetime  # type: ignore[misc]
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "dynstate" and getattr(module, "datetime", None) is base:
            module.datetime = ShiftedDatetime  # type: ignore[attr-defined]


def round_rows(worker: int, k: int) -> list[dict[str, Any]]:
    """Round ``k`` of ``worker``: a pure function of both, 3 to 30 rows over several shards."""
    n = 3 + (worker * 7 + k * 13) % 28
    return [
        {"w": worker, "k": k, "i": i, "text": f"{worker}/{k}/{i} " + "x" * (i % 17)}
        for i in range(n)
    ]


def round_outcomes(worker: int, k: int, num_rows: int) -> dict[str, list[Any]] | None:
    """The outcomes committed with round ``k`` of ``worker``: up to 4 records on rows of the
    version it is appended to (``num_rows`` rows, read just before), at a step of its own;
    None while the store is empty. A reset may shrink the head before the commit: the
    append is then refused (a typed error, nothing acknowledged)."""
    if num_rows == 0:
        return None
    n = 1 + (worker + k) % 4
    return {
        "row": [(worker * 31 + k * 7 + j * 5) % num_rows for j in range(n)],
        "step": [worker * 1_000_000 + k] * n,
        "score": [((worker * k + j) % 11) / 10 for j in range(n)],
        "length": [float(j + k % 5) for j in range(n)],
    }


# -- workers (each one process, forked from the preloaded forkserver) ---------------------


class _Acks:
    """A worker's acknowledgement log: one JSON line per version a call returned, written
    with one unbuffered write() before the worker does anything else."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def ack(self, **entry: Any) -> None:
        os.write(self._fd, (json.dumps(entry) + "\n").encode())

    def error(self, exc: BaseException) -> None:
        self.ack(error=type(exc).__name__, message=str(exc)[:300])


def worker_main(
    role: str, url: str, worker: int, workdir: Path, skew_s: float, seed: int, env: dict
) -> None:
    """A worker process (forked from the preloaded forkserver): its output to a log file,
    its clock shifted by ``skew_s``, then its role until it is killed."""
    os.environ.update(env)
    fd = os.open(workdir / f"stderr-{role}-{worker}.log", os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    shift_clock(skew_s)
    _worker(role, url, worker, workdir, seed)


def _worker(role: str, url: str, worker: int, workdir: Path, seed: int) -> None:
    from dynstate import DynstateError, Store

    rng = random.Random(seed)
    acks = _Acks(workdir / f"acks-{role}-{worker}.log")
    spool = workdir / "spool"
    if role == "gc":
        from dynstate import collect_garbage

        store = Store.open(url)
        while True:
            try:
                collect_garbage(store, grace_s=0, dry_run=False)
                acks.ack(gc=1)
            except DynstateError as exc:  # S3 faults past the retries: the next run goes on
                acks.error(exc)
    if role == "loader":
        _load_and_check(url, rng, acks)
    store = Store.open(url, lease_ttl_s=LEASE_TTL_S)
    k = 0
    while True:
        k += 1
        try:
            if role == "appender":
                # Every other round commits outcomes and a generator state with it, so that
                # gc, compaction and resets meet outcome files and checkpoints too.
                outcomes = state = None
                if k % 2 == 0:
                    outcomes = round_outcomes(worker, k, store.snapshot().num_rows)
                    state = {"worker": worker, "k": k}
                version = store.append(
                    round_rows(worker, k),
                    meta={"parts": [[worker, k]]},
                    shard_bytes=SHARD_BYTES,
                    outcomes=outcomes,
                    generator_state=state,
                )
                acks.ack(
                    v=version, kind="round", parts=[[worker, k]], outcomes=outcomes, state=state
                )
            elif role == "stager":
                _stage_and_hand_over(store, rng, acks, worker, k, spool)
            elif role == "committer":
                _take_over_and_commit(store, rng, acks, spool)
            elif role == "compactor":
                from dynstate import compact

                time.sleep(rng.uniform(0.5, 3.0))
                # With nothing to merge compact() commits nothing and returns the version it
                # looked at — possibly one another writer committed a moment before (a reset
                # to an empty version): only a record holding this call's meta is its ack.
                meta = {"compaction": [worker, k]}
                # A reset lands every few seconds and makes a compaction of the head before
                # it refuse (CommitConflictError): the resetter holds off while this flag is
                # fresh, so that compactions land too (a killed compactor's flag goes stale).
                flag = workdir / "compacting"
                flag.touch()
                # Now and then large shards (~2,000 rows): row groups that the loader's
                # batches read in part, through footer templates on S3.
                target = SHARD_BYTES * rng.choice([8, 8, 64])
                try:
                    version = compact(store, target_bytes=target, meta=meta)
                finally:
                    flag.unlink(missing_ok=True)
                if store.commit_record(version).meta == meta:
                    acks.ack(v=version, kind="compact")
            elif role == "resetter":
                time.sleep(rng.uniform(1.0, 5.0))
                if _fresh(workdir / "compacting", COMPACTION_HOLD_S):
                    continue
                head = store.refresh()
                target = max(store.log.read_floor(), head - rng.randint(0, 3))
                acks.ack(v=store.reset(target), kind="reset", target=target)
        except DynstateError as exc:  # a refused or failed call: nothing acknowledged
            acks.error(exc)
            time.sleep(0.05)


COMPACTION_HOLD_S = 20.0  # how long a compaction keeps the resetter off, at most


def _fresh(path: Path, max_age_s: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime < max_age_s
    except FileNotFoundError:
        return False


def _stage_and_hand_over(
    store: Any, rng: random.Random, acks: _Acks, worker: int, k: int, spool: Path
) -> None:
    """Stage a round and hand the pickled part to a committer; then, by a draw: go on
    staging (the heartbeat renews the lease until the commit), exit at once, or wait until
    the committer has taken the part over, renew the lease once more and die (SIGKILL) or
    exit — the lease file then names a dead process while the taker lives."""
    part = store.stage(round_rows(worker, k), shard_bytes=SHARD_BYTES)
    name = f"{worker}-{k}"
    tmp = spool / f".{name}.tmp"
    tmp.write_bytes(pickle.dumps(({"parts": [[worker, k]]}, part)))
    os.rename(tmp, spool / f"{name}.part")
    mode = rng.choices(["linger", "renew-die", "adopted-exit", "exit"], [5, 3, 2, 1])[0]
    acks.ack(handover=mode)
    if mode == "exit":
        os._exit(0)
    if mode == "linger":
        return
    deadline = time.monotonic() + 5
    while not (spool / f"{name}.adopted").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if mode == "renew-die":
        store.log.leases.renew(part.lease)
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


def _take_over_and_commit(store: Any, rng: random.Random, acks: _Acks, spool: Path) -> None:
    """Take one or two handed-over parts (unpickling takes their leases over), hold them a
    while — past the stager's lease, whose stager may be dead by then — and commit them."""
    taken = []
    for path in sorted(spool.glob("*.part"))[: rng.choice([1, 1, 2])]:
        mine = path.with_name(f"{path.stem}.taken-{os.getpid()}")
        try:
            os.rename(path, mine)  # one committer per part
        except FileNotFoundError:
            continue
        meta, part = pickle.loads(mine.read_bytes())
        (spool / f"{path.stem}.adopted").touch()
        taken.append((meta, part))
    if not taken:
        time.sleep(0.05)
        return
    time.sleep(rng.uniform(0, 2.5 * LEASE_TTL_S))
    parts = [p for _, p in taken]
    meta = {"parts": [pk for m, _ in taken for pk in m["parts"]]}
    w, k = meta["parts"][0]
    outcomes = round_outcomes(w, k, store.snapshot().num_rows) if k % 3 == 0 else None
    version = store.commit_staged(parts, meta=meta, outcomes=outcomes)
    acks.ack(v=version, kind="round", parts=meta["parts"], outcomes=outcomes, state=None)


# -- the loader -----------------------------------------------------------------------------

ROW = "_dynstate_row"


class Oracle:
    """A version's rows the plain way: the shards its manifest lists, read whole with pyarrow
    (bytes through fsspec; on S3 from the server directly, ``SOAK_DIRECT_ENDPOINT``, so
    that no fault and none of dynstate's readers stand between) and concatenated."""

    def __init__(self, url: str) -> None:
        import fsspec

        direct = os.environ.get("SOAK_DIRECT_ENDPOINT")
        if url.startswith("s3://"):
            self.fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": direct})
        else:
            self.fs = fsspec.filesystem("file")
        self.root = url.rstrip("/")
        self._tables: dict[str, Any] = {}  # by shard path: shards never change

    def table(self, snap: Any) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = []
        for shard in snap.shards:
            table = self._tables.get(shard.path)
            if table is None:
                data = self.fs.cat_file(f"{self.root}/{shard.path}")
                table = pq.read_table(pa.BufferReader(data))
                if len(self._tables) > 4096:
                    self._tables.clear()
                self._tables[shard.path] = table
            parts.append(table)
        return pa.concat_tables(parts, promote_options="default").select(snap.schema.names)

    def rows(self, snaps: dict[int, Any], entries: list[tuple[int, int]]) -> list[dict]:
        """(version, row) -> that row of that version, as a dict, in the order given."""
        import pyarrow as pa

        out: list[Any] = [None] * len(entries)
        for version, snap in snaps.items():
            at = [i for i, (v, _) in enumerate(entries) if v == version]
            taken = self.table(snap).take(pa.array([entries[i][1] for i in at], pa.int64()))
            for i, row in zip(at, taken.to_pylist(), strict=True):
                out[i] = row
        return out


def _loader_plan(rng: random.Random, snaps: dict[int, Any]) -> list[list[tuple[int, int]]]:
    """A few batches of (version, row): rows anywhere, a few of one shard, repeats, in
    random order."""
    batches = []
    for _ in range(rng.randint(1, 4)):
        entries: list[tuple[int, int]] = []
        for _ in range(rng.randint(1, 3)):
            version, snap = rng.choice(list(snaps.items()))
            if rng.random() < 0.5:  # a few rows of one shard (of its row groups)
                k = rng.randrange(len(snap.shards))
                lo = snap.offsets[k]
                rows = [
                    rng.randrange(lo, lo + snap.shards[k].rows) for _ in range(rng.randint(1, 8))
                ]
            else:
                rows = [rng.randrange(snap.num_rows) for _ in range(rng.randint(1, 16))]
            entries += [(version, r) for r in rows]
        entries += rng.choices(entries, k=rng.randint(0, 3))
        rng.shuffle(entries)
        batches.append(entries)
    return batches


def _as_is(batch: Any) -> Any:
    return batch


def _load_and_check(url: str, rng: random.Random, acks: _Acks) -> None:
    """The loader: batches of recent versions through a StatefulDataLoader (a dataset kept
    warm across rounds, or a fresh one), each compared with the oracle's rows. Logs
    ``batches`` (checked and right) or ``wrong`` (a batch that is not the oracle's), and
    errors a read or the oracle raised."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import DynstateError, Store, VersionedDataset
    from dynstate.loading.dataset import encode_index

    store = Store.open(url)
    oracle = Oracle(url)
    datasets: dict[str, Any] = {}
    while True:
        try:
            head = store.refresh()
            floor = store.log.read_floor()
            versions = {rng.randint(max(floor, head - 6), head) for _ in range(rng.randint(1, 3))}
            snaps = {v: store.snapshot(v) for v in versions}
            snaps = {v: snap for v, snap in snaps.items() if snap.num_rows}
            if not snaps:
                time.sleep(0.1)
                continue
            fmt = rng.choice(["rows", "columns", "arrow"])
            if fmt not in datasets or rng.random() < 0.1:  # now and then a cold cache
                # A small cache reads shards of a few KiB a row group at a time (the
                # ranged path, footer templates on S3), a large one reads them whole.
                size = rng.choice([64 * 1024, 512 * 2**20])
                datasets[fmt] = VersionedDataset(
                    url, batch_format=fmt, row_column=ROW, cache_bytes=size
                )
            plan = _loader_plan(rng, snaps)
            indices = [[encode_index(v, r) for v, r in batch] for batch in plan]
            loader = StatefulDataLoader(
                datasets[fmt], batch_sampler=indices, num_workers=0, collate_fn=_as_is
            )
            got = list(loader)
            wrong = []
            for batch, entries in zip(got, plan, strict=True):
                want = oracle.rows(snaps, entries)
                if fmt == "arrow":
                    batch = batch.to_pylist()
                elif fmt == "columns":
                    values = zip(*batch.values(), strict=True)
                    batch = [dict(zip(batch, row, strict=True)) for row in values]
                labels = [row.pop(ROW) for row in batch]
                if batch != want or labels != [r for _, r in entries]:
                    wrong.append(entries)
            if len(got) != len(plan) or wrong:
                acks.ack(wrong=f"format {fmt}: batches {wrong[:2]} are not the oracle's rows")
            else:
                multi = {
                    s.path
                    for snap in snaps.values()
                    for s in snap.shards
                    if s.groups is not None and len(s.groups.rows) > 1
                }
                acks.ack(
                    batches=len(got),
                    rows=sum(len(b) for b in plan),
                    many_groups=sum(
                        _shard_of(snaps[v], r).path in multi for b in plan for v, r in b
                    ),
                )
        except (DynstateError, OSError) as exc:  # S3 faults past the retries, and the like
            acks.error(exc)
            time.sleep(0.05)


def _shard_of(snap: Any, row: int) -> Any:
    return snap.shards[snap.locate(row)[0]]


# -- the auditor ----------------------------------------------------------------------------


def _lineage(store: Any, version: int | None) -> list[str]:
    """The outcome files of ``version``'s lineage, oldest first (paths)."""
    from dynstate.log.outcomes import outcomes_of

    if version is None:
        return []
    return [f.path for f in outcomes_of(store.log).lineage_files(version)]


def _tuples(table: Any) -> list[tuple[Any, ...]]:
    """Outcome records as sorted (row, step, score, length) tuples."""
    if not table.num_rows:  # (no extra columns either)
        return []
    columns = [table.column(c).to_pylist() for c in ("row", "step", "score", "length")]
    return sorted(zip(*columns, strict=True))


# Every this-many versions (and the head at the end) the statistics are checked against
# every raw outcome record of the lineage, which reads all its outcome files: once a lineage
# holds more files than a handle caches (STATS_FILES), every STATS_EVERY * ceil(files /
# STATS_FILES) versions, so each check's reads are paid for by as many versions and the
# audit's cost per version stays flat. (Every 25th version alone made the audit quadratic:
# a 120 s local run acknowledged 9,298 versions and its final audit took 277 s.)
STATS_EVERY = 25
STATS_FILES = 512


def stats_due(version: int, files: int) -> bool:
    """Whether the audit checks ``version``'s statistics, its lineage holding ``files``."""
    stride = STATS_EVERY * max(1, -(-files // STATS_FILES))
    return version % stride == 0


@dataclass
class Audit:
    """Reads each acknowledged version back as soon as its ack appears, and all of them (and
    every other version of the store) again at the end."""

    url: str
    workdir: Path
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    checked: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    gc_runs: int = 0
    handovers: Counter[str] = field(default_factory=Counter)
    checked_after_ack: int = 0
    stats_checked: int = 0
    loader: Counter[str] = field(default_factory=Counter)  # batches, rows checked
    _offsets: dict[str, int] = field(default_factory=dict)
    _verified: set[str] = field(default_factory=set)  # shards read back with their checksum
    _needed: dict[str, int] = field(default_factory=dict)  # shard -> an acked version's
    bad: dict[int, str] = field(default_factory=dict)  # acked versions lost or unreadable
    _listed: float = 0.0
    _unchecked: deque[int] = field(default_factory=deque)  # acked, not read back yet

    def poll(self, store: Any, budget_s: float | None = 0.5) -> None:
        """Read the new lines of every ack log and check the acknowledged versions now, for
        at most ``budget_s`` seconds (None: all of them): small commits acknowledge faster
        than a version is read back, and a poll that checked every one of them would starve
        the chaos loop of its kills and pauses. Versions left unchecked here are checked
        with all the others at the end (:meth:`final`)."""
        new = []
        for path in sorted(self.workdir.glob("acks-*.log")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path.name, 0))
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[path.name] = self._offsets.get(path.name, 0) + len(complete)
            for line in complete.decode().splitlines():
                entry = json.loads(line)
                if "error" in entry:
                    self.errors[entry["error"]] += 1
                elif "gc" in entry:
                    self.gc_runs += 1
                elif "handover" in entry:
                    self.handovers[entry["handover"]] += 1
                elif "batches" in entry:
                    self.loader.update(entry)
                elif "wrong" in entry:
                    self.loader["wrong"] += 1
                    self.problems.append(f"the loader: {entry['wrong']}")
                else:
                    entry["log"] = path.name
                    new.append(entry)
        for entry in new:
            version = entry["v"]
            if version in self.acks:
                self.problems.append(
                    f"version {version} acknowledged twice: {self.acks[version]} and {entry}"
                )
                continue
            self.acks[version] = entry
            self._unchecked.append(version)
        stop = None if budget_s is None else time.monotonic() + budget_s
        while self._unchecked and (stop is None or time.monotonic() < stop):
            version = self._unchecked.popleft()
            self.check(store, version, self.acks[version], "right after its ack")
        if new and time.monotonic() - self._listed > 2:
            self._listed = time.monotonic()
            self.check_present(store, "after its ack")

    def check(self, store: Any, version: int, entry: dict[str, Any], when: str) -> None:
        from dynstate import DynstateError

        try:
            store.refresh()
            record = store.commit_record(version)
            snap = store.snapshot(version)
            for shard in snap.shards:
                if shard.path not in self._verified:
                    store.read_shard(shard, snap.schema, version=version)  # checksum checked
                    self._verified.add(shard.path)
            if snap.num_rows != record.num_rows:
                raise AssertionError(f"lists {snap.num_rows} rows, its record {record.num_rows}")
            kind = entry.get("kind")
            if kind == "round":
                if record.meta.get("parts") != entry["parts"]:
                    raise AssertionError(f"holds {record.meta}, not the acknowledged round")
                added = [
                    r for s in record.add for r in store.read_shard(s, snap.schema).to_pylist()
                ]
                expected = [r for w, k in entry["parts"] for r in round_rows(w, k)]
                got = [{c: r.get(c) for c in ("w", "k", "i", "text")} for r in added]
                if got != expected:
                    raise AssertionError("its added rows are not the acknowledged round's")
                self.check_outcomes(store, version, record, entry)
            elif kind == "reset":
                if record.op != "reset" or snap.shards != store.snapshot(entry["target"]).shards:
                    raise AssertionError(f"is not a reset to {entry['target']}")
                if _lineage(store, version) != _lineage(store, entry["target"]):
                    raise AssertionError(f"holds other outcomes than {entry['target']}")
                if store.generator_state(version) != store.generator_state(entry["target"]):
                    raise AssertionError(f"holds another generator state than {entry['target']}")
            elif kind == "compact":
                if record.op != "compact":
                    raise AssertionError(f"is a {record.op}, not the acknowledged compaction")
                if _lineage(store, version) != _lineage(store, record.parent):
                    raise AssertionError("changed the outcomes it compacted")
            self.checked += 1
            for shard in snap.shards:
                self._needed.setdefault(shard.path, version)
        except (DynstateError, AssertionError, OSError) as exc:
            self._bad(version, f"{when}: {type(exc).__name__}: {exc}")

    def check_outcomes(self, store: Any, version: int, record: Any, entry: dict[str, Any]) -> None:
        """The acknowledged round's outcomes are in its version, exactly, once, on top of its
        parent's (the files it adds hold them; its lineage is its parent's plus those); its
        generator state (or the parent's, when it committed none) is the version's; and,
        at the versions :func:`stats_due` picks, the statistics agree with the raw records."""
        from dynstate.log.outcomes import outcomes_of

        sent = entry.get("outcomes")
        added = outcomes_of(store.log).added(record)
        got = sorted(
            t for f in added for t in _tuples(outcomes_of(store.log).read_file(f, version))
        )
        want = []
        if sent is not None:
            fields = (sent["row"], sent["step"], sent["score"], sent["length"])
            want = sorted(zip(*fields, strict=True))
        if got != want:
            raise AssertionError(f"holds outcomes {got}, not the acknowledged {want}")
        if _lineage(store, version) != _lineage(store, record.parent) + [f.path for f in added]:
            raise AssertionError("holds other outcomes than its parent's plus its own")
        state = entry.get("state")
        want_state = state if state is not None else store.generator_state(record.parent)
        if store.generator_state(version) != want_state:
            raise AssertionError(f"holds generator state {store.generator_state(version)}")
        if version % STATS_EVERY == 0 and stats_due(
            version, outcomes_of(store.log).lineage(version).count
        ):
            self.check_stats(store, version, record)

    def check_stats(self, store: Any, version: int, record: Any) -> None:
        """The statistics of ``version`` (an outcome checkpoint's aggregate plus the files
        since) agree with its raw outcome records: attempts and successes per row."""
        from dynstate.records.outcomes import DEFAULT_SUCCESS_ABOVE

        records = _tuples(store.outcome_records(version))
        stats = store.outcome_stats(version)
        if stats.num_rows != record.num_rows:
            raise AssertionError(f"has statistics of {stats.num_rows} rows")
        attempts = Counter(r[0] for r in records)
        successes = Counter(r[0] for r in records if r[2] > DEFAULT_SUCCESS_ABOVE)
        rows = stats.column("row").to_pylist()
        counted = zip(rows, stats.column("attempts").to_pylist(), strict=True)
        succeeded = zip(rows, stats.column("successes").to_pylist(), strict=True)
        if {r: n for r, n in counted if n} != attempts or {
            r: n for r, n in succeeded if n
        } != successes:
            raise AssertionError("has statistics that disagree with its outcome records")
        self.stats_checked += 1

    def _bad(self, version: int, what: str) -> None:
        if version not in self.bad:  # the first sighting says most
            entry = self.acks.get(version, {})
            self.bad[version] = (
                f"acknowledged version {version} ({entry.get('kind')}, {entry.get('log')}) {what}"
            )

    def check_present(self, store: Any, when: str) -> None:
        """Every shard an acknowledged version lists still exists (one listing)."""
        present = {f"data/{n}" for n in store.storage.list("data")}
        for path in self._needed.keys() - present:
            self._bad(self._needed[path], f"{when}: its shard {path} is gone")

    def final(self) -> dict[str, Any]:
        """A fresh reader: every acknowledged version checked again from scratch, every other
        version readable too, and verify over all versions."""
        from dynstate import DynstateError, Store, verify_store

        self._verified.clear()
        store = Store.open(self.url)
        self.poll(store, budget_s=0)  # the rest of the acks; all are checked just below
        self.checked_after_ack = self.checked
        for version, entry in sorted(self.acks.items()):
            self.check(store, version, entry, "at the end")
        self.check_present(store, "at the end")
        head = store.refresh()
        try:
            self.check_stats(store, head, store.commit_record(head))
        except (DynstateError, AssertionError) as exc:
            self.problems.append(f"the head {head}: {type(exc).__name__}: {exc}")
        unacked_broken = []
        for version in range(store.log.read_floor(), head + 1):
            if version in self.acks:
                continue
            try:
                snap = store.snapshot(version)
                for shard in snap.shards:
                    if shard.path not in self._verified:
                        store.read_shard(shard, snap.schema, version=version)
                        self._verified.add(shard.path)
            except Exception as exc:
                unacked_broken.append(f"{version}: {type(exc).__name__}: {exc}")
        if unacked_broken:
            self.problems.append(
                f"versions never acknowledged but unreadable: {unacked_broken[:5]}"
            )
        rounds: Counter[tuple[int, int]] = Counter()
        for record in store.versions():
            rounds.update(tuple(p) for p in record.meta.get("parts", []))
        twice = [p for p, n in rounds.items() if n > 1]
        if twice:
            self.problems.append(f"rounds committed more than once: {twice[:5]}")
        report = verify_store(store, all_versions=True)
        if not report.ok:
            self.problems.append(f"verify: {report.problems[:5]}")
        return {
            "head": head,
            "versions": head + 1,
            "shards": len(self._verified),
            "outcome_files_at_head": len(_lineage(store, head)),
        }


# -- the orchestrator -----------------------------------------------------------------------

ROLES = {
    "appender": 2,
    "stager": 2,
    "committer": 2,
    "compactor": 1,
    "resetter": 1,
    "gc": 1,
    "loader": 1,
}
# On S3 a gc run reads every kept record through the faults (tens of seconds): two of them,
# one ahead and one behind, so that gc judges as often as the writers commit.
ROLES_S3 = {**ROLES, "gc": 2}
KILL_WEIGHTS = {
    "appender": 4,
    "stager": 2,
    "committer": 3,
    "compactor": 1,
    "resetter": 1,
    "gc": 2,
    "loader": 1,
}
# SIGSTOP, for up to three lease ttls: writers lose their leases (their commits are refused),
# a committer stopped after its claim must keep its shards, and gc stopped between judging
# and deleting must delete nothing a commit names.
PAUSABLE = ("appender", "committer", "stager", "compactor", "gc")
# Seconds between two SIGKILLs, drawn uniformly: S3 calls are slower (and retried through
# the faults), so a worker there needs longer to get anything done between kills.
KILL_EVERY_S = {"local": (0.5, 3.0), "s3": (1.5, 6.0)}


@dataclass
class Worker:
    role: str
    number: int
    proc: Any  # a multiprocessing Process
    paused_until: float | None = None


_CTX: Any = None


def _context() -> Any:
    """A forkserver with dynstate preloaded: a worker starts in milliseconds (many are killed
    and replaced a minute), from a clean single-threaded parent."""
    global _CTX
    if _CTX is None:
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        _CTX = mp.get_context("forkserver")
        preload = ["soak_chaos", "dynstate", "dynstate.maintenance.gc", "pyarrow.parquet"]
        _CTX.set_forkserver_preload([*preload, "pyarrow.dataset", "pandas", "s3fs"])
    return _CTX


class Chaos:
    def __init__(
        self,
        url: str,
        workdir: Path,
        *,
        rng: random.Random,
        skew_s: float,
        env: dict[str, str],
        roles: dict[str, int],
    ) -> None:
        self.url, self.workdir, self.rng, self.skew_s = url, workdir, rng, skew_s
        self.env, self.roles = env, roles
        self.kill_every_s = KILL_EVERY_S["s3" if url.startswith("s3://") else "local"]
        self.workers: list[Worker] = []
        self.started = 0
        self.kills = 0
        self.pauses = 0
        self.exits = 0
        (workdir / "spool").mkdir()

    def start(self, role: str) -> None:
        self.started += 1
        # gc's clock is off by skew_s, alternately ahead and behind; writers' too, by a draw.
        if role == "gc":
            skew = self.skew_s if self.started % 2 else -self.skew_s
        else:
            skew = self.rng.choice([0.0, self.skew_s, -self.skew_s])
        import soak_chaos  # by module name, also when this file runs as __main__

        args = (role, self.url, self.started, self.workdir, skew, self.rng.randrange(2**32))
        proc = _context().Process(target=soak_chaos.worker_main, args=(*args, self.env))
        proc.start()
        self.workers.append(Worker(role, self.started, proc))

    def run(self, seconds: float, audit: Audit, store: Any) -> None:
        # The auditor reads acknowledged versions back on a thread of its own: on a loaded
        # machine a poll can take seconds, and the kills and pauses must keep their schedule.
        stop = threading.Event()
        failed: list[BaseException] = []

        def audit_loop() -> None:
            try:
                while not stop.is_set():
                    audit.poll(store)
                    stop.wait(0.1)
            except BaseException as exc:  # re-raised by run() once the chaos has stopped
                failed.append(exc)

        auditor = threading.Thread(target=audit_loop, name="soak-audit", daemon=True)
        auditor.start()
        try:
            self._chaos(seconds, audit.problems)
        finally:
            stop.set()
            auditor.join()
        if failed:
            raise failed[0]

    def _chaos(self, seconds: float, problems: list[str]) -> None:
        for role, n in self.roles.items():
            for _ in range(n):
                self.start(role)
        deadline = time.monotonic() + seconds
        next_kill = time.monotonic() + self.rng.uniform(*self.kill_every_s)
        next_pause = time.monotonic() + self.rng.uniform(1, 3)
        while time.monotonic() < deadline:
            now = time.monotonic()
            for w in list(self.workers):
                if w.paused_until is not None and now >= w.paused_until:
                    _signal(w, signal.SIGCONT)
                    w.paused_until = None
                if w.proc.exitcode is not None:  # exited (a stager's draw) or was killed
                    self.workers.remove(w)
                    if w.proc.exitcode not in (0, -signal.SIGKILL):
                        problems.append(
                            f"{w.role} {w.number} exited with {w.proc.exitcode}: {self._tail(w)}"
                        )
                    self.exits += w.proc.exitcode == 0
                    self.start(w.role)
            if now >= next_kill:
                self._kill()
                next_kill = now + self.rng.uniform(*self.kill_every_s)
            if now >= next_pause:
                running = [w for w in self.workers if w.role in PAUSABLE and w.paused_until is None]
                if running:
                    w = self.rng.choice(running)
                    _signal(w, signal.SIGSTOP)
                    w.paused_until = now + self.rng.uniform(0.2, 3 * LEASE_TTL_S)
                    self.pauses += 1
                next_pause = now + self.rng.uniform(1, 3)
            time.sleep(0.1)
        for w in self.workers:
            _signal(w, signal.SIGCONT)
            w.proc.kill()
            w.proc.join()

    def _kill(self) -> None:
        live = [w for w in self.workers if w.proc.exitcode is None]
        if not live:
            return
        weights = [KILL_WEIGHTS[w.role] for w in live]
        victim = self.rng.choices(live, weights)[0]
        victim.proc.kill()  # SIGKILL, paused or not
        victim.proc.join()
        self.kills += 1

    def _tail(self, w: Worker) -> str:
        path = self.workdir / f"stderr-{w.role}-{w.number}.log"
        return path.read_text(errors="replace")[-1500:]


def _signal(worker: Worker, sig: int) -> None:
    try:
        os.kill(worker.proc.pid, sig)
    except ProcessLookupError:
        pass  # it died meanwhile: the next round of the loop replaces it


def _serve_s3(fault_rate: float, seed: int) -> None:
    """Run moto and the fault proxy until stdin closes; print both addresses, then the
    faults injected."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from loopback_s3 import loopback_s3
    from s3_faults import FaultProxy

    with loopback_s3("dynstate-chaos") as server:
        proxy = FaultProxy(server.endpoint, rate=fault_rate, seed=seed, delay_s=0.5).start()
        print(server.endpoint, proxy.url, flush=True)
        sys.stdin.read()
        print(
            json.dumps({"faults": dict(proxy.faults), "requests": sum(proxy.counts.values())}),
            flush=True,
        )
        proxy.stop()


def soak(
    seconds: float,
    *,
    s3: bool = False,
    skew_s: float = 7200.0,
    seed: int = 0,
    fault_rate: float = 0.1,
    roles: dict[str, int] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Run the chaos for ``seconds``; the summary, with ``problems`` empty when nothing
    acknowledged was lost or unreadable."""
    from dynstate import Store, collect_garbage

    rng = random.Random(seed)
    tmp = tempfile.TemporaryDirectory(prefix="dynstate-chaos-") if workdir is None else None
    workdir = Path(tmp.name) if tmp is not None else workdir
    assert workdir is not None
    server = None
    env: dict[str, str] = {}
    saved = {k: os.environ.get(k) for k in _ENV}
    try:
        if s3:
            server = subprocess.Popen(
                [sys.executable, __file__, "--serve-s3", str(fault_rate), str(seed)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert server.stdout is not None
            direct, proxied = server.stdout.readline().split()
            os.environ.update(
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
                AWS_ENDPOINT_URL=direct,
            )
            # The workers meet the faults; the auditor and the loader's oracle not.
            env = {"AWS_ENDPOINT_URL": proxied, "SOAK_DIRECT_ENDPOINT": direct}
            url = f"s3://dynstate-chaos/{uuid_hex(rng)}"
        else:
            url = str(workdir / "store")
        store = Store.open(url, create=True)
        audit = Audit(url, workdir)
        roles = roles or (ROLES_S3 if s3 else ROLES)
        chaos = Chaos(url, workdir, rng=rng, skew_s=skew_s, env=env, roles=roles)
        start = time.monotonic()
        chaos.run(seconds, audit, store)
        chaos_s = time.monotonic() - start
        collect_garbage(
            Store.open(url), grace_s=0, dry_run=False
        )  # the writers are dead: their rounds go
        figures = audit.final()
        faults: dict[str, Any] = {}
        if server is not None:
            assert server.stdin is not None and server.stdout is not None
            server.stdin.close()
            faults = json.loads(server.stdout.readline())
        acked = Counter(e.get("kind") for e in audit.acks.values())
        return {
            "backend": "s3" if s3 else "local",
            "seconds": round(chaos_s),
            "final_audit_seconds": round(time.monotonic() - start - chaos_s),
            "seed": seed,
            "gc_skew_s": skew_s,
            "workers_started": chaos.started,
            "sigkills": chaos.kills,
            "sigstops": chaos.pauses,
            "stager_exits": chaos.exits,
            "handovers": dict(audit.handovers),
            "gc_runs": audit.gc_runs,
            "acknowledged": len(audit.acks),
            "acknowledged_by_kind": dict(acked),
            "checked_after_ack": audit.checked_after_ack,
            "checked_at_end": audit.checked - audit.checked_after_ack,
            "statistics_checked": audit.stats_checked,
            "loader_batches_checked": audit.loader["batches"],
            "loader_rows_checked": audit.loader["rows"],
            "loader_rows_in_shards_of_several_row_groups": audit.loader["many_groups"],
            "loader_wrong_batches": audit.loader["wrong"],
            "refused_or_failed_calls": dict(audit.errors),
            **figures,
            **faults,
            "lost_or_unreadable": len(audit.bad),
            "problems": [*audit.bad.values(), *audit.problems],
        }
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if tmp is not None:
            tmp.cleanup()


def uuid_hex(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--s3", action="store_true", help="loopback S3 behind the fault proxy")
    parser.add_argument("--skew", type=float, default=7200.0, help="gc's clock offset, seconds")
    parser.add_argument("--fault-rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--keep", type=Path, help="keep the store and logs in this folder")
    parser.add_argument("--serve-s3", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_s3:
        _serve_s3(float(args.serve_s3[0]), int(args.serve_s3[1]))
        return 0
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=False)
    summary = soak(
        args.seconds,
        s3=args.s3,
        skew_s=args.skew,
        seed=args.seed,
        fault_rate=args.fault_rate,
        workdir=args.keep,
    )
    print(json.dumps(summary, indent=1))
    if summary["problems"]:
        print(
            f"FAILED (seed {args.seed}): {summary['lost_or_unreadable']} acknowledged versions "
            f"lost or unreadable, {len(summary['problems'])} problems in all",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
