"""Hostile audit: concurrent writers that change the schema.

Writers in real OS processes (and threads sharing nothing but the path), each with its own
``Store.open`` handle on one local directory store, race appends that add a nullable column
(``allow_new_columns=True``), promote a column that is null so far (a top-level ``null``, a
struct field ``null``, a ``list<null>``), stage parts against one schema and commit them after
another writer changed it, run compaction and gc (grace 0, not a dry run) meanwhile, are paused
(SIGSTOP) between their validation and their commit, and are SIGKILLed at seeded instants.

The oracle, for every check:

* every kept version's shards, read whole with plain pyarrow and conformed to the version's
  schema here (missing columns as nulls), equal ``store.snapshot(v).to_arrow()``;
* every append version holds exactly the rows of the round its ``meta`` names (rows are a
  pure function of the meta token), in order, and every acknowledged append returned the
  version that holds its token;
* a refused append leaves no version and raises a ``DynstateError`` subclass;
* ``verify_store`` reports no problems at the end.

Docs cited: docs/format.md "Schema policy" and "The commit protocol"; docs/api.md.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynstate import DynstateError, SchemaMismatchError, Store, collect_garbage, verify_store
from dynstate.maintenance.compact import compact

CTX = mp.get_context("spawn")


# -- rows as a pure function of a token ------------------------------------------------------


def rows_for(w: int, k: int, kind: str, n: int = 3) -> list[dict[str, Any]]:
    """The rows of writer ``w``'s round ``k`` of ``kind``: the oracle recomputes them from the
    round's meta, so a version can be checked whoever wrote it (even a writer killed before it
    could report its acknowledgement)."""
    out = []
    for r in range(n):
        row: dict[str, Any] = {"w": w, "k": k, "r": r}
        if kind == "plain":
            pass
        elif kind == "x_int":
            row["x"] = w * 1000 + k * 10 + r
        elif kind == "x_str":
            row["x"] = f"s{w}.{k}.{r}"
        elif kind == "x_none":
            row["x"] = None
        elif kind == "y_float":
            row["y"] = w + k / 8 + r / 64
        elif kind == "s_int":
            row["s"] = {"a": r, "b": w * 100 + k}
        elif kind == "s_str":
            row["s"] = {"a": r, "b": f"b{w}.{k}"}
        elif kind == "s_none":
            row["s"] = {"a": r, "b": None}
        elif kind == "l_int":
            row["l"] = [w, k, r]
        elif kind == "l_str":
            row["l"] = [f"{w}", f"{k}"]
        elif kind == "l_empty":
            row["l"] = []
        elif kind == "s_int_ba":  # the struct's keys in the other order
            row["s"] = {"b": w * 100 + k, "a": r}
        elif kind == "src_none":  # the reserved lineage column, all None
            row["_dynstate_source"] = None
        elif kind == "src_rows":
            row["_dynstate_source"] = [0]
        else:  # pragma: no cover
            raise AssertionError(kind)
        out.append(row)
    return out


SEED_ROWS = {
    "x": [{"w": -1, "k": -1, "r": 0}],
    "null": [{"w": -1, "k": -1, "r": 0, "x": None}],
    "struct": [{"w": -1, "k": -1, "r": 0, "s": {"a": 0, "b": None}}],
    "list": [{"w": -1, "k": -1, "r": 0, "l": []}],
}


# -- writer processes ------------------------------------------------------------------------


def _log_line(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()


def _append_one(store: Store, w: int, k: int, kind: str, log: str, allow: bool) -> None:
    token = {"w": w, "k": k, "kind": kind}
    _log_line(log, {"event": "start", **token})
    try:
        v = store.append(rows_for(w, k, kind), meta=token, allow_new_columns=allow)
    except Exception as exc:
        _log_line(
            log,
            {
                "event": "refused",
                **token,
                "error": type(exc).__name__,
                "dynstate": isinstance(exc, DynstateError),
                "message": str(exc)[:400],
                "tb": "" if isinstance(exc, DynstateError) else traceback.format_exc()[-1500:],
            },
        )
        return
    _log_line(log, {"event": "ack", **token, "version": v})


def writer_proc(
    url: str, w: int, kinds: list[str], rounds: int, seed: int, log: str, start_at: float
) -> None:
    store = Store.open(url)
    rng = random.Random(seed * 7919 + w)
    while time.time() < start_at:
        time.sleep(0.005)
    for k in range(rounds):
        kind = rng.choice(kinds)
        _append_one(store, w, k, kind, log, allow=rng.random() < 0.8)
        time.sleep(rng.uniform(0.0, 0.03))


def maintenance_proc(
    url: str,
    seconds: float,
    seed: int,
    log: str,
    start_at: float,
    ops: tuple[str, ...] = ("compact", "gc"),
) -> None:
    """Compact and gc (grace 0, not a dry run; ``gc_keep``: keeping the newest 20 versions,
    which moves the floor) in a loop while the writers run."""
    store = Store.open(url)
    rng = random.Random(seed)
    while time.time() < start_at:
        time.sleep(0.005)
    end = time.time() + seconds
    while time.time() < end:
        op = rng.choice(ops)
        try:
            if op == "compact":
                compact(store, target_bytes=1 << 20)
            else:
                keep = 20 if op == "gc_keep" else None
                collect_garbage(store, keep=keep, grace_s=0, dry_run=False)
            _log_line(log, {"event": "maint", "op": op, "ok": True})
        except Exception as exc:
            _log_line(
                log,
                {
                    "event": "maint",
                    "op": op,
                    "ok": False,
                    "error": type(exc).__name__,
                    "dynstate": isinstance(exc, DynstateError),
                    "message": str(exc)[:400],
                },
            )
        time.sleep(rng.uniform(0.0, 0.05))


# -- the oracle ------------------------------------------------------------------------------


def _read_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line a SIGKILL cut short
                    pass
    return out


def conform_plain(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A shard read with plain pyarrow, shaped by this test (not dynstate) like its version's
    schema: columns in the schema's order, missing ones as nulls, each cast to the schema's
    type (a column stored while it was null, read at a version that gave it a type)."""
    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(column if column.type == field.type else column.cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def check_versions(root: str) -> list[str]:
    """Every kept version: its shards read whole with plain pyarrow and conformed here must
    equal ``to_arrow()``; returns the problems found."""
    problems: list[str] = []
    store = Store.open(root)
    for v in range(store.floor, store.head + 1):
        snap = store.snapshot(v)
        schema = snap.schema
        try:
            got = snap.to_arrow()
        except Exception as exc:
            problems.append(f"version {v}: to_arrow raised {type(exc).__name__}: {exc}")
            continue
        if schema is None:
            if got.num_rows:
                problems.append(f"version {v}: rows without a schema")
            continue
        parts = []
        for shard in snap.shards:
            raw = pq.read_table(os.path.join(root, shard.path))
            extra = [n for n in raw.column_names if n not in schema.names]
            if extra:
                problems.append(
                    f"version {v}: shard {shard.path} has columns {extra} the version's schema "
                    f"lacks ({schema.names})"
                )
            try:
                parts.append(conform_plain(raw, schema))
            except Exception as exc:
                problems.append(
                    f"version {v}: shard {shard.path} ({raw.schema}) does not conform to the "
                    f"version's schema ({schema}): {type(exc).__name__}: {exc}"
                )
        if len(parts) != len(snap.shards):
            continue
        want = pa.concat_tables(parts) if parts else schema.empty_table()
        if got.column_names != want.column_names:
            problems.append(f"version {v}: columns {got.column_names} != {want.column_names}")
        elif got.to_pylist() != want.to_pylist():
            problems.append(f"version {v}: to_arrow rows differ from the shards read plainly")
        for field in schema:
            if field.name in got.column_names and got.schema.field(field.name).type != field.type:
                problems.append(
                    f"version {v}: to_arrow column {field.name} is "
                    f"{got.schema.field(field.name).type}, the schema says {field.type}"
                )
        if got.num_rows != snap.num_rows:
            problems.append(f"version {v}: {got.num_rows} rows read, record says {snap.num_rows}")
    return problems


def check_rounds(root: str, logs: list[str], seed_rows: list[dict[str, Any]] | None) -> list[str]:
    """Every append version holds the rows its meta token names, in order; acknowledged
    tokens hold the version they were told; refused ones are in no version and were refused
    with a DynstateError."""
    problems: list[str] = []
    store = Store.open(root)
    entries = [e for log in logs for e in _read_log(log)]
    acked = {(e["w"], e["k"]): e for e in entries if e["event"] == "ack"}
    refused = {(e["w"], e["k"]): e for e in entries if e["event"] == "refused"}
    for e in refused.values():
        if not e["dynstate"]:
            problems.append(
                f"round {e['w']}/{e['k']} ({e['kind']}) refused with a raw {e['error']}: "
                f"{e['message']}\n{e['tb']}"
            )
    for e in entries:
        if e["event"] == "maint" and not e["ok"] and not e["dynstate"]:
            problems.append(f"{e['op']} raised a raw {e['error']}: {e['message']}")
    seen: dict[tuple[int, int], int] = {}
    for v in range(max(store.floor, 1), store.head + 1):
        record = store.commit_record(v)
        if record.op != "append" or "w" not in record.meta:
            continue
        key = (record.meta["w"], record.meta["k"])
        if key in seen:
            problems.append(f"round {key} committed twice: versions {seen[key]} and {v}")
        seen[key] = v
        rows = store.snapshot(v).to_arrow()
        before = store.commit_record(v - 1).num_rows if v - 1 >= store.floor else None
        start = record.num_rows - record.rows_added
        if before is not None and before != start:
            problems.append(f"version {v}: parent has {before} rows, record adds from {start}")
        got = rows.slice(start).to_pylist()
        want = rows_for(record.meta["w"], record.meta["k"], record.meta["kind"])
        want = [{name: row.get(name) for name in rows.column_names} for row in want]
        if got != want:
            problems.append(f"version {v} ({record.meta}): rows {got} != given {want}")
        if key in refused:
            problems.append(f"round {key} was refused ({refused[key]['error']}) yet is version {v}")
        if key in acked and acked[key]["version"] != v:
            problems.append(f"round {key} acknowledged as {acked[key]['version']}, found at {v}")
    for key, e in acked.items():
        if key not in seen and e["version"] >= store.floor:
            problems.append(f"acknowledged round {key} (version {e['version']}) is in no version")
    if seed_rows is not None and store.floor <= 1:
        first = store.snapshot(1).to_arrow().to_pylist()
        want = [{n: r.get(n) for n in store.snapshot(1).to_arrow().column_names} for r in seed_rows]
        if first != want:
            problems.append(f"the seed round reads {first}, was given {want}")
    return problems


def check_all(root: str, logs: list[str], seed_rows: list[dict[str, Any]] | None) -> list[str]:
    problems = check_versions(root) + check_rounds(root, logs, seed_rows)
    report = verify_store(Store.open(root), all_versions=True)
    problems += [f"verify: {p}" for p in report.problems]
    return problems


def leftovers(root: str) -> list[str]:
    """Files a refused or finished round must not leave behind: shards and outcome files in
    ``data/`` that no kept version names, and lease files."""
    store = Store.open(root)
    named = {s.path for v in range(store.floor, store.head + 1) for s in store.snapshot(v).shards}
    for v in range(store.floor, store.head + 1):
        named |= {f.path for f in store.commit_record(v).add}
        named |= {f.path for f in store.outcome_log.files(store.outcome_log.lineage(v))}
    data = {f"data/{n}" for n in os.listdir(os.path.join(root, "data"))}
    leases = os.path.join(root, "_dynstate", "leases")
    lease_files = [f"leases/{n}" for n in os.listdir(leases)] if os.path.isdir(leases) else []
    return sorted(data - named) + lease_files


def _new_store(tmp_path: Path, name: str, seed_rows: list[dict[str, Any]] | None) -> str:
    root = str(tmp_path / name)
    store = Store.open(root, create=True)
    if seed_rows is not None:
        store.append(seed_rows)
    return root


def _run_procs(procs: list[Any], timeout: float = 90) -> None:
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():  # pragma: no cover - a hang is a failure of its own
            p.kill()
            p.join()
            raise AssertionError(f"process {p.name} hung")


# -- racing processes ------------------------------------------------------------------------

RACES = {
    # a writer adds x:int, one adds x:str, one appends rows without x, one adds y
    "x": ["x_int", "x_str", "plain", "y_float", "x_none"],
    # x is null so far: promoted to int by one writer, to str by another
    "null": ["x_int", "x_str", "x_none"],
    # s.b is null so far
    "struct": ["s_int", "s_str", "s_none"],
    # l is list<null> so far
    "list": ["l_int", "l_str", "l_empty"],
}


@pytest.mark.parametrize("race", sorted(RACES))
def test_racing_schema_changes_with_compaction_and_gc(tmp_path: Path, race: str) -> None:
    """Guard. Three writer processes race rounds of kinds that add or promote the same column
    to different types, while a fourth compacts and runs gc (grace 0). Every version reads as
    its shards do, every round holds the rows its writer gave, refusals are typed and leave no
    version, and verify finds nothing (docs/format.md "Schema policy", "The commit protocol":
    a rebased round must still fit the new head's schema, else SchemaMismatchError)."""
    seed = sum(map(ord, race))
    root = _new_store(tmp_path, race, SEED_ROWS[race])
    logs = [str(tmp_path / f"w{w}.log") for w in range(4)]
    start_at = time.time() + 3.0
    procs = [
        CTX.Process(target=writer_proc, args=(root, w, RACES[race], 8, seed, logs[w], start_at))
        for w in range(3)
    ]
    procs.append(CTX.Process(target=maintenance_proc, args=(root, 4.0, seed, logs[3], start_at)))
    _run_procs(procs)
    assert all(p.exitcode == 0 for p in procs)
    problems = check_all(root, logs, SEED_ROWS[race])
    assert not problems, "\n".join(problems)
    acks = sum(e["event"] == "ack" for log in logs for e in _read_log(log))
    assert acks >= 3


# -- a writer paused (SIGSTOP) between its validation and its commit -------------------------


def _arm_pause(point: str) -> None:
    """Make this process stop itself (SIGSTOP) the next time it reaches ``point`` of an
    append: ``validated`` (the round was checked against the head's schema, no shard written
    yet), ``claimed`` (shards written and lease claimed, record not built) or ``publish``
    (the record was built on its parent; its exclusive create is next)."""
    from dynstate.log.commits import Log
    from dynstate.writes import Writer

    def once(cls: Any, name: str, before: bool) -> None:
        orig = getattr(cls, name)

        def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
            setattr(cls, name, orig)
            if before:
                os.kill(os.getpid(), signal.SIGSTOP)
                return orig(self, *args, **kwargs)
            out = orig(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGSTOP)
            return out

        setattr(cls, name, hooked)

    if point == "validated":
        once(Writer, "_conform_round", before=False)
    elif point == "claimed":
        once(Log, "commit", before=True)
    elif point == "publish":
        once(Log, "_publish", before=True)
    else:  # pragma: no cover
        raise AssertionError(point)


def paused_writer_proc(jobs: list[tuple[str, str, int, bool, str]], point: str) -> None:
    for root, kind, k, allow, log in jobs:
        store = Store.open(root)
        store.refresh()
        _arm_pause(point)
        _append_one(store, 0, k, kind, log, allow)


def _wait_stopped(pid: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} never stopped")


def _wait_logged(log: str, k: int, timeout: float = 30) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in _read_log(log):
            if e.get("k") == k and e["event"] in ("ack", "refused"):
                return e
        time.sleep(0.01)
    raise AssertionError(f"round {k} never ended")


# (seed rows, the paused writer's round, the other writer's round, the paused one is acked)
PAUSED = [
    ("x", "plain", "x_int", False),  # the other added x: rows without it no longer fit
    ("x", "x_int", "x_int", True),  # both added x:int: the same schema, rebased
    ("x", "x_int", "x_str", False),  # the same name, another type
    ("x", "y_float", "x_int", False),  # two different new columns
    ("null", "x_int", "x_str", False),  # x null so far: promoted to str meanwhile
    ("null", "x_int", "x_int", True),  # promoted to the same type meanwhile
    ("null", "x_none", "x_int", False),  # docs: refused once another writer changed it
    ("struct", "s_int", "s_str", False),
    ("struct", "s_int", "s_int", True),
    ("list", "l_int", "l_str", False),
    ("list", "l_int", "l_int", True),
    ("struct", "s_int_ba", "s_int", True),  # fields by name, in any order
    ("x", "src_none", "src_rows", True),  # _dynstate_source is list<int64> even when all None
]


@pytest.mark.parametrize(
    ("point", "keep"),
    [("validated", None), ("claimed", None), ("publish", None), ("publish", 1)],
)
def test_writer_paused_while_another_changes_the_schema(
    tmp_path: Path, point: str, keep: int | None
) -> None:
    """Guard. A writer process validated its round against the old schema and was stopped
    (SIGSTOP) at ``point``; meanwhile another process changed the schema (added or promoted
    the same column), compacted and ran gc at grace 0; then the writer was resumed (SIGCONT).
    A round that no longer fits is refused with SchemaMismatchError and leaves no version; one
    whose schema is the new head's is rebased and committed (docs/format.md, "The commit
    protocol": "if the other writer changed the schema, the round must still fit it, else
    SchemaMismatchError"; "Schema policy": a part validated against the old schema is refused
    at commit once another writer changed it). With ``keep=1`` the other process appends
    twice and gc moves the floor past the paused writer's parent and frees its record's name,
    so the paused create lands below the floor (the stray path of "The commit protocol",
    check (a)): the round is committed again above the floor only if it still fits."""
    jobs = []
    for i, (seed, mine, _theirs, _ok) in enumerate(PAUSED):
        root = _new_store(tmp_path, f"s{i}", SEED_ROWS[seed])
        jobs.append((root, mine, i, True, str(tmp_path / f"paused{i}.log")))
    proc = CTX.Process(target=paused_writer_proc, args=(jobs, point))
    proc.start()
    try:
        for i, (_seed, _mine, theirs, ok) in enumerate(PAUSED):
            root = jobs[i][0]
            _wait_stopped(proc.pid)
            other = Store.open(root)
            other.append(
                rows_for(1, i, theirs),
                meta={"w": 1, "k": i, "kind": theirs},
                allow_new_columns=True,
            )
            if keep is None:
                compact(other, target_bytes=1 << 20)
            else:
                other.append(
                    rows_for(1, 100 + i, theirs), meta={"w": 1, "k": 100 + i, "kind": theirs}
                )
            collect_garbage(other, keep=keep, grace_s=0, dry_run=False)
            os.kill(proc.pid, signal.SIGCONT)
            e = _wait_logged(jobs[i][4], i)
            assert (e["event"] == "ack") == ok, (PAUSED[i], e)
            if not ok:
                assert e["error"] == "SchemaMismatchError", (PAUSED[i], e)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(timeout=30)
    assert proc.exitcode == 0
    for i in range(len(PAUSED)):
        problems = check_all(jobs[i][0], [jobs[i][4]], SEED_ROWS[PAUSED[i][0]])
        problems += [f"left behind: {f}" for f in leftovers(jobs[i][0])]
        assert not problems, (PAUSED[i], problems)


# -- staged parts committed after another writer changed the schema --------------------------


def stager_proc(jobs: list[tuple[str, str, int]], out: Any, done: Any) -> None:
    """Stage one part per job (each against its store's head) and hand it over; stay alive
    (renewing the leases) until the committer is done, as docs/format.md's Leases ask."""
    for root, kind, k in jobs:
        store = Store.open(root)
        try:
            part = store.stage(rows_for(2, k, kind), allow_new_columns=True)
            out.put((k, part, None))
        except Exception as exc:
            out.put((k, None, f"{type(exc).__name__}: {exc}"))
    done.wait(timeout=120)


# (seed rows, part A's round, part B's round or None, the other writer's round, committed)
STAGED = [
    ("x", "plain", None, "x_int", False),
    ("x", "x_int", None, "x_int", True),
    ("x", "x_int", None, "x_str", False),
    ("x", "x_int", "x_int", "x_int", True),  # B staged after the other's commit: same schema
    ("x", "x_int", "plain", "x_int", True),  # B (without x) is refused at stage; A commits
    ("null", "x_int", None, "x_str", False),
    ("null", "x_int", "x_int", "x_int", True),
    ("null", "x_none", None, "x_int", False),
    ("struct", "s_int", None, "s_str", False),
    ("struct", "s_int", "s_int", "s_int", True),
    ("list", "l_int", None, "l_str", False),
    ("list", "l_int", "l_int", "l_int", True),
]


def test_staged_parts_committed_after_a_schema_change(tmp_path: Path) -> None:
    """Guard. Part A is staged by one process against the old schema; another process then
    changes the schema (adds or promotes the same column), compacts and runs gc at grace 0;
    part B (if any) is staged by the first process after that; this process commits the parts
    together. A part validated against the old schema whose schema is not the new head's is
    refused with SchemaMismatchError and no version; parts whose schema is the head's commit
    their rows (docs/format.md, "Schema policy": "A staged part validated against the old
    schema is refused at commit once another writer changed it")."""
    stores = [_new_store(tmp_path, f"s{i}", SEED_ROWS[c[0]]) for i, c in enumerate(STAGED)]
    first = CTX.Queue()
    second = CTX.Queue()
    done1, done2 = CTX.Event(), CTX.Event()
    jobs_a = [(stores[i], c[1], i) for i, c in enumerate(STAGED)]
    proc_a = CTX.Process(target=stager_proc, args=(jobs_a, first, done1))
    proc_a.start()
    try:
        parts_a = {}
        for _ in STAGED:
            k, part, err = first.get(timeout=60)
            assert err is None, err
            parts_a[k] = part
        for i, c in enumerate(STAGED):
            other = Store.open(stores[i])
            other.append(
                rows_for(1, i, c[3]), meta={"w": 1, "k": i, "kind": c[3]}, allow_new_columns=True
            )
            compact(other, target_bytes=1 << 20)
            collect_garbage(other, grace_s=0, dry_run=False)
        jobs_b = [(stores[i], c[2], i) for i, c in enumerate(STAGED) if c[2] is not None]
        proc_b = CTX.Process(target=stager_proc, args=(jobs_b, second, done2))
        proc_b.start()
        parts_b: dict[int, Any] = {}
        for _ in jobs_b:
            k, part, err = second.get(timeout=60)
            parts_b[k] = part if err is None else err
        log = str(tmp_path / "staged.log")
        for i, c in enumerate(STAGED):
            store = Store.open(stores[i])
            b = parts_b.get(i)
            if isinstance(b, str):  # refused at stage: the round does not fit the head
                assert b.startswith("SchemaMismatchError"), b
                b = None
            parts = [parts_a[i]] + ([b] if b is not None else [])
            token = {"w": 2, "k": i, "kind": c[1]}
            try:
                v = store.commit_staged(parts, meta=token if b is None else None)
            except DynstateError as exc:
                assert isinstance(exc, SchemaMismatchError), (c, exc)
                assert not c[4], (c, exc)
                assert Store.open(stores[i]).head == store.head, c
                continue
            assert c[4], (c, v)
            rows = Store.open(stores[i]).snapshot(v).to_arrow()
            want = rows_for(2, i, c[1]) + (rows_for(2, i, c[2]) if b is not None else [])
            got = rows.slice(rows.num_rows - len(want)).to_pylist()
            assert got == [{n: r.get(n) for n in rows.column_names} for r in want], c
            if b is None:
                _log_line(log, {"event": "ack", **token, "version": v})
        done1.set()
        done2.set()
        proc_b.join(timeout=30)
    finally:
        done1.set()
        done2.set()
        proc_a.join(timeout=30)
    for i, c in enumerate(STAGED):
        problems = check_versions(stores[i]) + [
            p for p in verify_store(Store.open(stores[i]), all_versions=True).problems
        ]
        assert not problems, (c, problems)


# -- an empty round raced by a schema change -------------------------------------------------


def empty_round_proc(root: str, how: str, log: str) -> None:
    store = Store.open(root)
    store.refresh()
    _arm_pause("claimed")
    token = {"w": 3, "k": 0, "kind": how}
    try:
        if how == "meta":
            v = store.append([], meta=token)
        else:
            v = store.append([], meta=token, outcomes={"row": [0], "step": [5], "score": [1.0]})
    except Exception as exc:
        _log_line(
            log, {"event": "refused", **token, "error": type(exc).__name__, "message": str(exc)}
        )
        return
    _log_line(log, {"event": "ack", **token, "version": v})


@pytest.mark.parametrize("how", ["meta", "outcomes"])
def test_empty_round_is_refused_when_another_writer_adds_a_column(tmp_path: Path, how) -> None:
    """DEFECT (fixed). An empty round (``append([])`` with only ``meta``, or a step that added no
    rows but recorded its outcomes) that loses the commit race to a writer adding a nullable column
    is refused with ``SchemaMismatchError: ... missing columns: x`` (promoting a null column
    meanwhile gives "changed types: x (int64 -> null)"), although the round has no columns at
    all. docs/format.md "Schema policy": "An empty round without columns fits any schema; an
    empty round is a commit like any other"; docs/api.md: "data may be empty ([]: a step that
    added no rows)"; "The commit protocol": a rebased round is refused only if it no longer
    fits. Cause: Writer._conform_round (dynstate/writes.py:769) gives a column-less empty
    round the head's schema as its own, append stages it with that schema and the head's
    fingerprint as ``validated`` (writes.py:139-140), commit_staged keeps shard-less parts in
    the check when no part has shards (writes.py:371), and Writer._append_record
    (writes.py:807-817) refuses the round because "its" schema is not the new head's.
    Expected: the empty round is rebased and committed, its record naming the head's schema
    (as _append_record already does for ``schema is None``). In a training loop, a step's
    outcomes (and meta, generator state) are lost whenever a generator process adds or
    promotes a column meanwhile."""
    root = _new_store(tmp_path, "s", [{"w": -1, "k": -1, "r": 0}])
    log = str(tmp_path / "empty.log")
    proc = CTX.Process(target=empty_round_proc, args=(root, how, log))
    proc.start()
    try:
        _wait_stopped(proc.pid)
        Store.open(root).append(
            rows_for(1, 0, "x_int"), meta={"w": 1, "k": 0, "kind": "x_int"}, allow_new_columns=True
        )
        os.kill(proc.pid, signal.SIGCONT)
        e = _wait_logged(log, 0)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(timeout=30)
    store = Store.open(root)
    assert not check_versions(root)
    assert verify_store(store).problems == []
    assert not leftovers(root)
    assert e["event"] == "ack", f"the empty round was refused: {e['error']}: {e['message']}"
    assert store.head == 3
    assert store.commit_record(3).meta == {"w": 3, "k": 0, "kind": how}
    assert store.snapshot(3).schema == store.snapshot(2).schema
    assert store.snapshot(3).to_arrow().equals(store.snapshot(2).to_arrow())


# -- SIGKILL at seeded instants --------------------------------------------------------------


def test_writers_killed_at_random_while_changing_the_schema(tmp_path: Path) -> None:
    """Guard. Writer processes racing schema changes (a column added as int, as str, as null,
    promoted; rows without it; another column) are SIGKILLed at seeded instants and replaced,
    while compaction and gc (grace 0) run. Afterwards (and after a final gc) every version
    reads as its shards do, every version's round holds the rows its meta names, and verify
    finds nothing (docs/format.md, "Crash-safety argument"). gc also moves the floor
    (keeping 20 versions), so writers meet the stray-record path of "The commit protocol"."""
    rng = random.Random(20240611)
    root = _new_store(tmp_path, "s", SEED_ROWS["null"])
    kinds = ["x_int", "x_str", "x_none", "plain", "y_float"]
    logs: list[str] = []
    start_at = time.time() + 2.0
    maint_log = str(tmp_path / "maint.log")
    maint = CTX.Process(
        target=maintenance_proc,
        args=(root, 7.0, 7, maint_log, start_at, ("compact", "gc", "gc_keep")),
    )
    maint.start()
    live: list[Any] = []
    w = 0

    def spawn() -> None:
        nonlocal w
        logs.append(str(tmp_path / f"w{w}.log"))
        p = CTX.Process(target=writer_proc, args=(root, w, kinds, 400, 11, logs[-1], start_at))
        p.start()
        live.append(p)
        w += 1

    for _ in range(2):
        spawn()
    time.sleep(max(0.0, start_at - time.time()))
    killed = 0
    end = time.time() + 5.0
    while time.time() < end:
        time.sleep(rng.uniform(0.2, 0.6))
        # a writer that has started appending (not one still importing)
        running = [p for p, log in zip(live, logs, strict=True) if p.is_alive() and _read_log(log)]
        if running:
            victim = rng.choice(running)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
            killed += 1
            spawn()
    for p in live:
        if p.is_alive():
            p.kill()
        p.join()
    maint.join(timeout=60)
    assert maint.exitcode == 0
    assert killed >= 3
    collect_garbage(Store.open(root), grace_s=0, dry_run=False)
    problems = check_all(root, [*logs, maint_log], SEED_ROWS["null"])
    assert not problems, "\n".join(problems)


# -- threads sharing nothing but the path ----------------------------------------------------


def test_threads_racing_schema_changes(tmp_path: Path) -> None:
    """Guard. Threads of one process, each with its own Store handle on the path (the
    process-wide caches of fresh and decoded shards shared), race the promotion of a struct
    field and a list<null> column and the addition of columns, with a compacting and gc
    thread. The oracle as for processes."""
    root = _new_store(
        tmp_path, "s", [{"w": -1, "k": -1, "r": 0, "s": {"a": 0, "b": None}, "l": []}]
    )
    kinds = {
        0: ["s_int", "l_int", "x_int", "s_none"],
        1: ["s_str", "l_str", "x_str", "l_empty"],
        2: ["s_none", "l_empty", "s_int_ba"],
    }
    logs = [str(tmp_path / f"t{w}.log") for w in range(4)]
    barrier = threading.Barrier(4)

    def run(w: int) -> None:
        store = Store.open(root)
        rng = random.Random(w)
        barrier.wait()
        for k in range(25):
            token = {"w": w, "k": k, "kind": "+".join(rng.sample(kinds[w], 2))}
            _log_line(logs[w], {"event": "start", **token})
            rows = [
                dict(a, **b)
                for a, b in zip(*(rows_for(w, k, t) for t in token["kind"].split("+")), strict=True)
            ]
            try:
                v = store.append(rows, meta=token, allow_new_columns=True)
            except Exception as exc:
                _log_line(
                    logs[w],
                    {
                        "event": "refused",
                        **token,
                        "error": type(exc).__name__,
                        "dynstate": isinstance(exc, DynstateError),
                        "message": str(exc)[:300],
                        "tb": "",
                    },
                )
                continue
            _log_line(logs[w], {"event": "ack", **token, "version": v})

    def maintain() -> None:
        store = Store.open(root)
        barrier.wait()
        i = 0
        while any(t.is_alive() for t in threads[:3]):
            i += 1
            try:
                if i % 2:
                    compact(store, target_bytes=1 << 20)
                else:
                    collect_garbage(store, grace_s=0, dry_run=False)
            except Exception as exc:
                _log_line(
                    logs[3],
                    {
                        "event": "maint",
                        "op": str(i),
                        "ok": False,
                        "error": type(exc).__name__,
                        "dynstate": isinstance(exc, DynstateError),
                        "message": str(exc)[:300],
                    },
                )

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    threads.append(threading.Thread(target=maintain))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    problems = check_versions(root)
    entries = [e for log in logs for e in _read_log(log)]
    problems += [
        f"raw {e['error']}: {e['message']}"
        for e in entries
        if e["event"] in ("refused", "maint") and not e["dynstate"]
    ]
    store = Store.open(root)
    acked = {(e["w"], e["k"]): e for e in entries if e["event"] == "ack"}
    for v in range(2, store.head + 1):
        record = store.commit_record(v)
        if record.op != "append":
            continue
        key = (record.meta["w"], record.meta["k"])
        parts = [rows_for(key[0], key[1], t) for t in record.meta["kind"].split("+")]
        want = [dict(a, **b) for a, b in zip(*parts, strict=True)]
        rows = store.snapshot(v).to_arrow()
        got = rows.slice(record.num_rows - record.rows_added).to_pylist()
        if got != [{n: r.get(n) for n in rows.column_names} for r in want]:
            problems.append(f"version {v}: {got} != {want}")
        if acked.get(key, {}).get("version") != v:
            problems.append(f"version {v} holds {key}, which was not acknowledged as {v}")
    problems += verify_store(store, all_versions=True).problems
    assert not problems, "\n".join(problems)
    assert acked


# -- a compaction paused while another writer changes the schema -----------------------------


def paused_compactor_proc(jobs: list[tuple[str, str]], point: str, log: str) -> None:
    for root, _ in jobs:
        store = Store.open(root)
        _arm_pause(point)
        try:
            v = compact(store, target_bytes=1 << 20)
            _log_line(log, {"event": "compacted", "root": root, "version": v})
        except Exception as exc:
            _log_line(
                log,
                {
                    "event": "compact_failed",
                    "root": root,
                    "error": type(exc).__name__,
                    "dynstate": isinstance(exc, DynstateError),
                    "message": str(exc)[:300],
                },
            )


@pytest.mark.parametrize("point", ["claimed", "publish"])
def test_compaction_paused_while_another_writer_changes_the_schema(tmp_path: Path, point) -> None:
    """Guard. A compaction process rewrote a version whose column is null (or lacks a column)
    and was stopped before its record; another process then promoted the column (top level,
    struct field, list<null>) or added one, over two rounds; the compaction resumes and
    rebases over those appends (docs/format.md "The commit protocol": a compaction rebases
    only over appends, and its record carries the head's schema). Every version still reads
    as its shards do, with the compacted rows first."""
    cases = [("null", "x_int"), ("x", "x_str"), ("struct", "s_str"), ("list", "l_int")]
    roots = []
    for i, (seed, _) in enumerate(cases):
        root = _new_store(tmp_path, f"s{i}", SEED_ROWS[seed])
        store = Store.open(root)
        for k in range(3):  # small shards to merge, the column still null
            kind = {"null": "x_none", "x": "plain", "struct": "s_none", "list": "l_empty"}[seed]
            store.append(rows_for(5, k, kind), meta={"w": 5, "k": k, "kind": kind})
        roots.append(root)
    log = str(tmp_path / "compact.log")
    jobs = [(root, kind) for root, (_, kind) in zip(roots, cases, strict=True)]
    proc = CTX.Process(target=paused_compactor_proc, args=(jobs, point, log))
    proc.start()
    try:
        for i, (_, kind) in enumerate(cases):
            _wait_stopped(proc.pid)
            other = Store.open(roots[i])
            for k in range(2):
                other.append(
                    rows_for(1, k, kind),
                    meta={"w": 1, "k": k, "kind": kind},
                    allow_new_columns=True,
                )
            collect_garbage(other, grace_s=0, dry_run=False)
            os.kill(proc.pid, signal.SIGCONT)
            deadline = time.time() + 30
            while len(_read_log(log)) <= i and time.time() < deadline:
                time.sleep(0.01)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(timeout=30)
    entries = _read_log(log)
    assert [e["event"] for e in entries] == ["compacted"] * len(cases), entries
    for i, root in enumerate(roots):
        store = Store.open(root)
        assert store.commit_record(store.head).op == "compact", cases[i]
        assert store.snapshot(store.head).to_arrow().to_pylist() == (
            store.snapshot(store.head - 1).to_arrow().to_pylist()
        )
        problems = check_all(root, [], SEED_ROWS[cases[i][0]])
        assert not problems, (cases[i], problems)
