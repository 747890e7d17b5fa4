"""A process dying between any two lines (SPEC §3.1, §3.3, §3.12).

The random-delay kill tests (tests/test_store_crash.py, tests/test_outcomes_crash.py,
tools/soak_store.py) land where the clock happens to put them. Here each operation runs in a
child process that counts the ``line`` events of the frames of ``dynstate/`` (every thread
started after the tracer is installed) and SIGKILLs itself at the k-th one: first a dry run
counts N, then kills at points spread over 1..N (the first and last few always among them).
After each kill the store is checked against plain oracles, not dynstate's fast paths alone:

(a) ``dynstate verify URL --all`` exits 0;
(b) the head is the old head or the one the operation commits (gc and tags: the old one);
(c) every kept version's rows equal its Parquet shards read whole with pyarrow (the shard
    lists folded from the JSON records by hand, docs/format.md), and dynstate's
    ``snapshot().to_arrow()`` and ``VersionedDataset.read_batch`` (unsorted, repeated
    indices) equal that;
(d) ``outcome_stats`` (attempts, mean score) and ``outcome_records`` of every kept version
    equal a fold of the raw outcome records this test appended, along the lineage the
    records name; ``generator_state`` is the lineage's last one;
(e) the same operation run again succeeds, or fails with a typed ``DynstateError``; then gc
    at grace 0 with its clock eight days ahead, and (a)-(d) hold again, with no shard or
    outcome file left that no file of the store names;
(f) nothing was created or deleted outside the store folder (the child runs with its own
    ``TMPDIR`` and ``HOME``; the per-user decoded-shard folder, docs/api.md, is allowed).

The suite runs one kill set per operation; ``DYNSTATE_CRASH_ALL=1`` adds the S3 runs and
compact at version 100, and ``DYNSTATE_CRASH_POINTS`` / ``DYNSTATE_CRASH_IO_POINTS`` set how many
kill points (a soak).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PKG = str(ROOT / "dynstate") + os.sep
_VENV_PY = ROOT / ".venv" / "bin" / "python"
PY = str(_VENV_PY) if _VENV_PY.exists() else sys.executable
_VENV_CLI = ROOT / ".venv" / "bin" / "dynstate"
CLI = [str(_VENV_CLI)] if _VENV_CLI.exists() else [PY, "-m", "dynstate"]

# kill points per operation: spread over all its lines, and over its local file-system calls
# (the suite's share; DYNSTATE_CRASH_POINTS=200 DYNSTATE_CRASH_IO_POINTS=2000 for a dense run,
# which found nothing either)
POINTS = int(os.environ.get("DYNSTATE_CRASH_POINTS", "12"))
IO_POINTS = int(os.environ.get("DYNSTATE_CRASH_IO_POINTS", "16"))
TEMPLATE_HEAD = 5  # versions 1..5 of the prepared store, one round of step v-1 each

# --------------------------------------------------------------------------------------------
# The child: runs one operation under a line counter, and kills itself at the chosen point.

BUILD = r"""
def build(dynstate, store, args, committed):
    op = args["op"]
    step = args.get("step")
    rows = args.get("rows")
    outs = args.get("outcomes")
    gen = args.get("generator_state")
    committed.update({"outcomes": outs, "generator_state": gen, "consumption": None})

    if op == "append":
        act = lambda: store.append(rows, meta={"step": step})
    elif op == "append_outcomes":
        act = lambda: store.append(rows, meta={"step": step}, outcomes=outs, generator_state=gen)
    elif op == "compact":
        act = lambda: dynstate.compact(store, target_bytes=1 << 20)
    elif op == "gc":
        act = lambda: dynstate.collect_garbage(store, keep=2, grace_s=0, dry_run=False) and None
    elif op == "reset":
        act = lambda: store.reset(2)
    elif op == "rollback":
        act = lambda: dynstate.rollback(store, step=2)
    elif op == "tag":
        act = lambda: store.tag("fresh", 4)
    elif op == "tag_force":
        act = lambda: store.tag("best", 5, force=True)
    elif op == "staged":
        def act():
            one = store.stage(rows[:2])
            two = store.stage(rows[2:])
            return store.commit_staged([one, two], meta={"step": step}, outcomes=outs)
    elif op == "dynsamp":
        ds = dynstate.VersionedDataset(store, row_column="_dynstate_row")
        sampler = dynstate.VersionedSampler(ds, seed=0, shuffle=True)
        dyn = dynstate.DynamicSampling(ds, sampler, gen_batch_size=4, train_groups=2)
        dyn.resume(None, first_step=step)

        def score(items, s):
            return [[0.0, 1.0] if it["_dynstate_row"] % 2 == 0 else [1.0, 1.0] for it in items]

        batch = dyn.next_batch(step, score)
        outs = [dict(o) for o in batch.outcomes()]
        committed["outcomes"] = outs
        committed["consumption"] = batch.record
        act = lambda: store.append(rows, meta={"step": step}, outcomes=outs,
                                   rows_version=batch.rows_version, consumption=batch.record)
    else:
        raise SystemExit(f"unknown op {op}")
    return act
"""

DRIVER = (
    BUILD
    + r"""
# A zygote: imports once, then forks one child per request (a line naming an args file on
# stdin); the child runs the operation under the line counter and dies at its point; the
# zygote answers with the child's exit status (negative: the signal).
import json, os, re, signal, sys, tempfile, threading, traceback

PKG = sys.argv[1]
LIBROOT = os.path.dirname(PKG.rstrip(os.sep))

import importlib
import pandas, pyarrow, pyarrow.parquet  # imported before arming: module bodies are no kill points
import dynstate
_SKIP = r"dynstate\.(verl|trl|serve|cli|ray|__main__|maintenance\.plot"
if sys.argv[2] != "loading":
    _SKIP += r"|loading|history|maintenance\.export"
for _dir, _subs, _files in os.walk(PKG):
    for _f in sorted(_files):
        if not _f.endswith(".py"):
            continue
        _name = os.path.relpath(os.path.join(_dir, _f), LIBROOT)
        _name = _name[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if not re.match(_SKIP + r")\b", _name):
            importlib.import_module(_name)


def child(args):
    kill = args.get("kill")
    counts = {}
    lock = threading.Lock()
    state = {"armed": False}
    trace = [] if kill is None else None

    def key():
        if threading.current_thread() is threading.main_thread():
            return "main"
        return re.sub(r"[-_\d]+$", "", threading.current_thread().name)

    def die(frame, k, n):
        rel = os.path.relpath(frame.f_code.co_filename, LIBROOT)
        fd = os.open(args["loc"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, json.dumps({"where": f"{rel}:{frame.f_lineno}",
                                 "func": frame.f_code.co_name, "thread": k, "k": n}).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    def local(frame, event, arg):
        if event == "line" and state["armed"]:
            k = key()
            with lock:
                n = counts[k] = counts.get(k, 0) + 1
            if trace is not None and k == "main":
                trace.append(os.path.relpath(frame.f_code.co_filename, LIBROOT)
                             + f":{frame.f_lineno}")
            if kill is not None:
                if "thread" in kill:
                    if k == kill["thread"] and n == kill["k"]:
                        die(frame, k, n)
                else:
                    here = os.path.relpath(frame.f_code.co_filename, LIBROOT)
                    here += f":{frame.f_lineno}"
                    if here == kill["at"]:
                        with lock:
                            seen = counts[here] = counts.get(here, 0) + 1
                        if seen == kill.get("nth", 1):
                            die(frame, k, n)
        return local

    def glob(frame, event, arg):
        if frame.f_code.co_filename.startswith(PKG):
            return local
        return None

    threading.settrace(glob)
    sys.settrace(glob)
    store = dynstate.Store.open(args["url"])
    committed = {}
    act = build(dynstate, store, args, committed)
    result = {"error": None}
    state["armed"] = True
    try:
        result["value"] = act()
    except dynstate.DynstateError as exc:
        result["error"] = [type(exc).__name__, str(exc)]
    except BaseException as exc:
        result["error"] = ["UNTYPED:" + type(exc).__name__, traceback.format_exc()]
    state["armed"] = False
    # what interpreter exit does: executors shut down, non-daemon threads (an outcome
    # checkpoint) joined
    threading._shutdown()
    sys.settrace(None)
    threading.settrace(None)
    result["counts"] = {k: v for k, v in counts.items() if ":" not in k}
    result["committed"] = committed
    result["trace"] = trace
    with open(args["out"], "w") as f:
        json.dump(result, f, default=str)


for line in sys.stdin:
    args = json.loads(open(line.strip()).read())
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chdir(args["cwd"])
            os.environ.update(args["env"])
            tempfile.tempdir = None
            err = os.open(args["out"] + ".stderr", os.O_WRONLY | os.O_CREAT, 0o600)
            os.dup2(err, 2)
            child(args)
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    sys.stdout.write(json.dumps({"rc": rc}) + "\n")
    sys.stdout.flush()
"""
)


# --------------------------------------------------------------------------------------------
# The prepared store and what was appended to it.


def round_rows(step: int, n: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "i": step * 100 + j,
            "s": f"step {step} row {j} " + "x" * ((step * 7 + j) % 5),
            "l": [step, j] * (j % 3),
        }
        for j in range(n)
    ]


def round_outcomes(step: int, rows_before: int) -> list[dict[str, Any]]:
    return [
        {"row": (step * 3 + j) % rows_before, "step": step, "score": ((step + j) % 4) / 4.0}
        for j in range(4)
    ]


@dataclass
class Template:
    url: str  # a local folder or an s3:// URL
    outcomes: dict[int, list[dict[str, Any]]]  # version -> outcomes of its lineage
    gen_state: dict[int, Any]  # version -> generator state of its lineage
    rows: dict[int, int]  # version -> row count


def make_template(url: str, *, extra: int = 0) -> Template:
    """Versions 1..5 (+ ``extra`` plain appends): rows of ints, strings and lists, the rounds
    of steps 1.. with outcomes, step 2's with a generator state; tag ``best`` at 3."""
    import dynstate

    store = dynstate.Store.open(url, create=True)
    outcomes: dict[int, list[dict[str, Any]]] = {0: []}
    gens: dict[int, Any] = {0: None}
    rows: dict[int, int] = {0: 0}
    for step in range(TEMPLATE_HEAD + extra):
        before = rows[store.head]
        outs = round_outcomes(step, before) if step >= 1 else None
        gen = {"seen": step, "pool": ["a", step]} if step == 2 else None
        v = store.append(
            round_rows(step, 4 if step == 0 else 3),
            meta={"step": step},
            outcomes=outs,
            generator_state=gen,
        )
        outcomes[v] = outcomes[v - 1] + list(outs or [])
        gens[v] = gen if gen is not None else gens[v - 1]
        rows[v] = store.snapshot(v).num_rows
    store.tag("best", 3)
    return Template(url, outcomes, gens, rows)


# --------------------------------------------------------------------------------------------
# Plain oracles: the records and shards read by hand.


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


class LocalFiles:
    """A store's files on a local disk, read plainly."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, rel: str) -> bytes | None:
        p = self.root / rel
        return p.read_bytes() if p.is_file() else None

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())


class S3Files:
    """A store's objects on S3, read plainly with boto3."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix.rstrip("/") + "/"

    def get(self, rel: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.prefix + rel)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def list(self, prefix: str) -> list[str]:
        out = []
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            out += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
        return sorted(out)


class Oracle:
    def __init__(self, files: Any) -> None:
        self.files = files
        self.memo: dict[int, list[dict[str, Any]]] = {}

    def _json(self, rel: str) -> dict[str, Any] | None:
        data = self.files.get(rel)
        return None if data is None else json.loads(data)

    def record(self, v: int) -> dict[str, Any] | None:
        return self._json(f"_dynstate/log/{v:020d}.json")

    def checkpoint(self, v: int) -> dict[str, Any] | None:
        return self._json(f"_dynstate/checkpoints/{v:020d}.json")

    def head(self) -> int:
        nums = sorted(int(m.group(1)) for p in self.files.list("_dynstate/log/")
                      if (m := re.fullmatch(r"_dynstate/log/(\d{20})\.json", p)))  # fmt: skip
        return nums[-1]

    def floor(self) -> int:
        gc = self._json("_dynstate/gc.json")
        return int(gc["floor"]) if gc is not None else 0

    def expand(self, shard_list: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for digest in shard_list["chunks"]:
            chunk = self._json(f"_dynstate/chunks/{digest}.json")
            assert chunk is not None, f"chunk {digest} is missing"
            for i, p in enumerate(chunk["path"]):
                out.append({"path": p, "rows": chunk["rows"][i], "bytes": chunk["bytes"][i],
                            "sha256": chunk["sha256"][i]})  # fmt: skip
        return out + list(shard_list["tail"])

    def shards(self, v: int) -> list[dict[str, Any]]:
        if v in self.memo:
            return self.memo[v]
        rec = self.record(v)
        assert rec is not None, f"record of kept version {v} is missing"
        if v > 0 and v == self.floor():
            # below the floor records may be half deleted; its checkpoint is written before
            # gc.json names it (docs/format.md, "gc.json")
            ck = self.checkpoint(v)
            assert ck is not None, f"no checkpoint of the floor {v}"
            got = self.expand(ck["shards"])
        elif rec.get("base") is not None:
            got = self.expand(rec["base"])
        else:
            parent = rec["parent"]
            if self.record(parent) is not None:
                got = self.shards(parent) + list(rec["add"])
            elif (ck := self.checkpoint(v)) is not None:
                got = self.expand(ck["shards"])
            else:
                ck = self.checkpoint(parent)
                assert ck is not None, f"version {v}: no parent record and no checkpoint"
                got = self.expand(ck["shards"]) + list(rec["add"])
        self.memo[v] = got
        return got

    def table(self, v: int) -> pa.Table:
        parts = []
        for entry in self.shards(v):
            data = self.files.get(entry["path"])
            assert data is not None, f"{entry['path']}: missing"
            assert len(data) == entry["bytes"], f"{entry['path']}: size"
            assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{entry['path']}: sha"
            parts.append(pq.read_table(pa.BufferReader(data)))
        if not parts:
            return pa.table({})
        return pa.concat_tables([t.replace_schema_metadata(None) for t in parts])


def fold(records: list[dict[str, Any]]) -> dict[int, tuple[int, float]]:
    by_row: dict[int, list[float]] = {}
    for r in records:
        by_row.setdefault(int(r["row"]), []).append(float(r["score"]))
    return {row: (len(s), math.fsum(s) / len(s)) for row, s in by_row.items()}


# --------------------------------------------------------------------------------------------
# One operation, its kills and its checks.


@dataclass
class Op:
    name: str
    heads: Callable[[int], set[int]]  # old head -> heads allowed after a kill
    step: int | None = None
    rows: list[dict[str, Any]] | None = None
    outcomes: list[dict[str, Any]] | None = None
    generator_state: Any = None
    tags: Callable[[dict[str, int]], bool] = lambda t: t.get("best") == 3
    floors: set[int] = field(default_factory=lambda: {0})
    rerun_errors: tuple[str, ...] = ()  # typed errors a rerun may answer with
    rerun_heads: Callable[[int], set[int]] | None = None  # old head -> heads after a rerun


def _plus_one(h: int) -> set[int]:
    return {h, h + 1}


def _same(h: int) -> set[int]:
    return {h}


def _ops(template: Template) -> dict[str, Op]:
    s = max(template.rows)  # the step of the next round (version v holds step v - 1's)
    before = template.rows[s]
    rows = round_rows(s)
    return {
        "append": Op("append", _plus_one, step=s, rows=rows),
        "append_outcomes": Op(
            "append_outcomes",
            _plus_one,
            step=s,
            rows=rows,
            outcomes=round_outcomes(s, before),
            generator_state={"seen": s, "pool": ["b", s]},
            rerun_errors=("InvalidDataError",),
        ),
        "compact": Op("compact", _plus_one),
        "gc": Op("gc", _same, floors={0, 3}),  # keep=2: 4 and 5; the tag holds 3
        "reset": Op("reset", _plus_one),
        "rollback": Op("rollback", _plus_one),
        "tag": Op("tag", _same, tags=lambda t: t.get("best") == 3 and t.get("fresh") in (None, 4)),
        "tag_force": Op("tag_force", _same, tags=lambda t: t.get("best") in (3, 5)),
        "staged": Op(
            "staged",
            _plus_one,
            step=s,
            rows=round_rows(s, 4),
            outcomes=round_outcomes(s, before),
            rerun_errors=("InvalidDataError",),
        ),
        # a rerun is a new DynamicSampling: resume(None) rolls back the crashed run's round
        # (a reset), then the step commits again
        "dynsamp": Op(
            "dynsamp", _plus_one, step=s, rows=rows, rerun_heads=lambda h: {h + 1, h + 3}
        ),
    }


def _build() -> Callable[..., Callable[[], Any]]:
    space: dict[str, Any] = {}
    exec(BUILD, space)
    return space["build"]


def _listing(root: Path, skip: set[Path]) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if d / n not in skip]
        for n in dirnames + filenames:
            out.add(str((d / n).relative_to(root)))
    return out


class LocalLoc:
    """Trials in ``<trial>/store`` on the local disk, copied from the template's folder."""

    io = "dynstate/storage/local"  # the lines between file-system calls

    def url(self, trial: Path) -> str:
        return str(trial / "store")

    def files(self, trial: Path) -> LocalFiles:
        return LocalFiles(trial / "store")

    def copy(self, template: Template, trial: Path) -> None:
        shutil.copytree(template.url, trial / "store")


class S3Loc:
    """Trials at ``s3://<bucket>/<run>/<trial name>``, copied object by object (server side)
    from the template's prefix."""

    io = ("dynstate/storage/objectstore", "dynstate/storage/s3obstore")  # around requests

    def __init__(self, bucket: str) -> None:
        import boto3

        self.client = boto3.client("s3")
        self.bucket = bucket
        self.run = uuid.uuid4().hex

    def prefix(self, trial: Path) -> str:
        return f"{self.run}/{trial.parent.name}-{trial.name}"

    def url(self, trial: Path) -> str:
        return f"s3://{self.bucket}/{self.prefix(trial)}"

    def files(self, trial: Path) -> S3Files:
        return S3Files(self.client, self.bucket, self.prefix(trial))

    def copy(self, template: Template, trial: Path) -> None:
        src = template.url.removeprefix(f"s3://{self.bucket}/").rstrip("/") + "/"
        dst = self.prefix(trial) + "/"
        for rel in S3Files(self.client, self.bucket, src).list(""):
            source = {"Bucket": self.bucket, "Key": src + rel}
            self.client.copy_object(Bucket=self.bucket, Key=dst + rel, CopySource=source)


class Zygote:
    """A driver process that imported everything once and forks a child per trial."""

    def __init__(self, driver: Path, home: Path, imports: str) -> None:
        env = dict(os.environ, TMPDIR=str(home), HOME=str(home))
        env.pop("DYNSTATE_DECODED_CACHE", None)
        self.proc = subprocess.Popen(
            [PY, str(driver), PKG, imports], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=home,
        )  # fmt: skip

    def run(self, argf: Path) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{argf}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (rc {self.proc.poll()})"
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@dataclass
class Trial:
    point: dict[str, Any]
    dir: Path
    killed: bool = False
    where: dict[str, Any] | None = None
    child: dict[str, Any] | None = None
    verify: tuple[int, str] = (0, "")
    outside_before: set[str] = field(default_factory=set)


class Harness:
    def __init__(
        self, base: Path, template: Template, op: Op, loc: Any = None, points: int = 0
    ) -> None:
        self.loc = loc if loc is not None else LocalLoc()
        self.n_points, self.n_io = (points, points) if points else (POINTS, IO_POINTS)
        self.base = base
        self.template = template
        self.op = op
        self.driver = base / "driver.py"
        if not self.driver.exists():
            self.driver.write_text(DRIVER)
        self.problems: list[str] = []
        self.where_seen: Counter[str] = Counter()
        self.zygotes: queue.Queue[Zygote] = queue.Queue()
        home = base / "zygote"
        home.mkdir(exist_ok=True)
        for _ in range(2):
            self.zygotes.put(Zygote(self.driver, home, "loading" if op.name == "dynsamp" else ""))

    def close(self) -> None:
        while not self.zygotes.empty():
            self.zygotes.get().close()

    # -- children ----------------------------------------------------------------------------

    def env(self, trial: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["TMPDIR"] = str(trial / "tmp")
        env["HOME"] = str(trial / "home")
        env.pop("DYNSTATE_DECODED_CACHE", None)
        return env

    def args(self, trial: Path, kill: dict[str, Any] | None, tag: str) -> dict[str, Any]:
        return {
            "pkg": PKG, "url": self.loc.url(trial), "op": self.op.name, "kill": kill,
            "out": str(trial / f"{tag}.out.json"), "loc": str(trial / f"{tag}.loc.json"),
            "step": self.op.step, "rows": self.op.rows, "outcomes": self.op.outcomes,
            "generator_state": self.op.generator_state,
        }  # fmt: skip

    def run_child(self, trial: Path, kill: dict[str, Any] | None, tag: str) -> dict[str, Any]:
        args = self.args(trial, kill, tag)
        args["cwd"] = str(trial)
        args["env"] = {"TMPDIR": str(trial / "tmp"), "HOME": str(trial / "home")}
        argf = trial / f"{tag}.args.json"
        argf.write_text(json.dumps(args))
        zygote = self.zygotes.get()
        try:
            rc = zygote.run(argf)
        finally:
            self.zygotes.put(zygote)
        err = Path(args["out"] + ".stderr")
        out: dict[str, Any] = {"rc": rc, "stderr": err.read_text()[-3000:] if err.exists() else ""}
        if Path(args["out"]).exists():
            out.update(_json(Path(args["out"])))
        if Path(args["loc"]).exists():
            out["where"] = _json(Path(args["loc"]))
        return out

    def verify_cli(self, trial: Path) -> tuple[int, str]:
        proc = subprocess.run(
            [*CLI, "verify", "--all", self.loc.url(trial)], cwd=trial, env=self.env(trial),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return proc.returncode, (proc.stdout + proc.stderr)[-2000:]

    def fresh_trial(self, name: str) -> Path:
        trial = self.base / name
        if trial.exists():
            shutil.rmtree(trial)
        trial.mkdir()
        (trial / "tmp").mkdir()
        (trial / "home").mkdir()
        self.loc.copy(self.template, trial)
        return trial

    def outside(self, trial: Path) -> set[str]:
        uid = os.getuid()
        return {
            # the per-user decoded shards and a remote store's local disk cache (docs/api.md)
            p for p in _listing(trial, {trial / "store", trial / "tmp" / f"dynstate-decoded-{uid}",
                                        trial / "tmp" / "dynstate-cache"})
            if not re.fullmatch(r"(dry|kill|rerun)\.(args|out|loc)\.json(\.stderr)?", p)
        }  # fmt: skip

    # -- the run -------------------------------------------------------------------------------

    def dry_run(self) -> dict[str, Any]:
        trial = self.fresh_trial("dry")
        before = self.outside(trial)
        out = self.run_child(trial, None, "dry")
        assert out["rc"] == 0 and out.get("error") is None, out
        assert self.outside(trial) == before, self.outside(trial) ^ before
        self.committed = out["committed"]
        return out

    def points(self, dry: dict[str, Any]) -> list[dict[str, Any]]:
        """Kill points of the main thread: ``POINTS`` spread evenly over 1..N (the first and
        last three always), and ``IO_POINTS`` spread over the events in the local storage
        backend (every line between two file-system calls, where a kill leaves a file half
        made); a few points in each other thread."""
        counts, trace = dry["counts"], dry["trace"]
        n = counts["main"]
        ks = {1, 2, 3, n - 2, n - 1, n}
        ks |= {1 + round(i * (n - 1) / (self.n_points - 1)) for i in range(self.n_points)}
        io = [k + 1 for k, where in enumerate(trace) if where.startswith(self.loc.io)]
        if len(io) <= self.n_io:
            ks |= set(io)
        else:
            ks |= {io[round(i * (len(io) - 1) / (self.n_io - 1))] for i in range(self.n_io)}
        pts = [{"thread": "main", "k": k} for k in sorted(k for k in ks if 1 <= k <= n)]
        for key, m in sorted(counts.items()):
            if key in ("main", "dynstate-lease-heartbeat"):
                continue  # the heartbeat wakes by the clock: its count is not deterministic
            pts += [{"thread": key, "k": k} for k in sorted({1, (m + 1) // 2, m}) if k >= 1]
        return pts

    def kill_one(self, point: dict[str, Any], name: str) -> Trial:
        trial = self.fresh_trial(name)
        t = Trial(point, trial, outside_before=self.outside(trial))
        t.child = self.run_child(trial, point, "kill")
        t.killed = t.child["rc"] == -9
        t.where = t.child.get("where")
        t.verify = self.verify_cli(trial)
        return t

    def sweep(self, points: list[dict[str, Any]], workers: int = 2) -> list[Trial]:
        with ThreadPoolExecutor(workers) as pool:
            trials = list(pool.map(lambda ip: self.kill_one(ip[1], f"k{ip[0]:03d}"),
                                   enumerate(points)))  # fmt: skip
        for t in trials:
            self.check_trial(t)
        return trials

    # -- checks --------------------------------------------------------------------------------

    def problem(self, t: Trial, what: str) -> None:
        where = t.where["where"] if t.where else "(no kill)"
        self.problems.append(f"[{self.op.name} kill {t.point} at {where}] {what}")

    def check_trial(self, t: Trial, rerun: bool = True) -> None:
        import dynstate

        if t.where:
            self.where_seen[t.where["where"]] += 1
        if not t.killed and t.child and t.child.get("error"):
            self.problem(t, f"unkilled child failed: {t.child['error']}")
        if t.child and t.child["rc"] not in (0, -9):
            self.problem(t, f"child rc {t.child['rc']}: {t.child['stderr'][-800:]}")
        old = self.template_head()
        self.check_store(t, "after kill", self.op.heads(old))
        if not rerun:
            return
        err = self.rerun(t)
        if err is not None and err[0] not in self.op.rerun_errors:
            self.problem(t, f"rerun failed: {err[0]}: {err[1][:600]}")
        heads = self.op.heads(old) | {h + 1 for h in self.op.heads(old)}
        if self.op.heads(old) == {old}:
            heads = {old}
        if self.op.rerun_heads is not None:
            heads = self.op.rerun_heads(old)
        self.cleanup_gc(t)
        report = dynstate.verify_store(dynstate.Store.open(self.loc.url(t.dir)), all_versions=True)
        t.verify = (1 if report.problems else 0, str(report.problems)[:2000])
        self.check_store(t, "after rerun + gc", heads, orphans=True)

    def rerun(self, t: Trial) -> tuple[str, str] | None:
        """The same operation again, in this process, on a fresh handle."""
        import dynstate

        try:
            store = dynstate.Store.open(self.loc.url(t.dir))
            act = _build()(dynstate, store, self.args(t.dir, None, "rerun"), {})
            try:
                act()
            finally:
                # what the end of a process does: the outcome checkpoint thread of a 100th
                # version finishes (not a daemon); gc below must not race it
                for th in threading.enumerate():
                    if th.name.startswith("dynstate-outcome-checkpoint-"):
                        th.join()
        except dynstate.DynstateError as exc:
            return type(exc).__name__, str(exc)
        except Exception as exc:
            return "UNTYPED:" + type(exc).__name__, repr(exc)
        return None

    def template_head(self) -> int:
        return max(self.template.rows)

    def cleanup_gc(self, t: Trial) -> None:
        import dynstate

        store = dynstate.Store.open(self.loc.url(t.dir))
        try:
            # twice: the first ends the dead writer's lease, whose tombstone the second removes
            for _ in range(2):
                dynstate.collect_garbage(
                    store, grace_s=0, dry_run=False, clock=lambda: store.storage.now() + 8 * 86400
                )
        except dynstate.DynstateError as exc:
            self.problem(t, f"gc at grace 0 after the kill failed: {type(exc).__name__}: {exc}")

    def expected(self, oracle: Oracle, v: int) -> tuple[list[dict[str, Any]], Any, int]:
        """(outcome records, generator state, consumption records) of version ``v``'s lineage,
        folded from what this test appended, along the lineage the plain records name."""
        tpl = self.template
        if v <= self.template_head():
            return tpl.outcomes[v], tpl.gen_state[v], 0
        rec = oracle.record(v)
        assert rec is not None
        if rec["op"] == "reset":
            return self.expected(oracle, rec["target"])
        outs, gen, cons = self.expected(oracle, rec["parent"])
        if rec["op"] == "append":
            if "outcomes" in rec and rec["outcomes"].get("records", 0) > 0:
                outs = outs + list(self.committed["outcomes"] or [])
            if rec.get("generator_state") is not None:
                gen = rec["generator_state"]
                assert gen == self.committed["generator_state"], (gen, self.committed)
            if rec.get("consumption") is not None:
                cons += 1
        return outs, gen, cons

    def check_store(self, t: Trial, phase: str, heads: set[int], orphans: bool = False) -> None:
        # read through the trial's TMPDIR: decoded files the killed child left there
        # (docs/api.md, "Decoded shards shared between processes") are what later readers map
        saved = tempfile.tempdir
        tempfile.tempdir = str(t.dir / "tmp")
        try:
            self._check_store(t, phase, heads, orphans)
        finally:
            tempfile.tempdir = saved

    def _check_store(self, t: Trial, phase: str, heads: set[int], orphans: bool) -> None:
        import dynstate

        rc, text = t.verify
        if rc != 0:
            self.problem(t, f"{phase}: dynstate verify --all exited {rc}: {text}")
        try:
            oracle = Oracle(self.loc.files(t.dir))
            head = oracle.head()
            floor = oracle.floor()
            if head not in heads:
                self.problem(t, f"{phase}: head {head}, expected one of {sorted(heads)}")
            if floor not in self.op.floors:
                self.problem(t, f"{phase}: floor {floor}, expected one of {self.op.floors}")
            store = dynstate.Store.open(self.loc.url(t.dir))
            if store.head != head:
                self.problem(t, f"{phase}: Store.head {store.head} != log's highest {head}")
            tags = store.tags()
            if not self.op.tags(tags):
                self.problem(t, f"{phase}: tags {tags}")
            # a long template: its old versions are checked once, in the dry run's store
            first = floor if self.template_head() < 20 else max(floor, self.template_head() - 2)
            for v in range(first, head + 1):
                if oracle.record(v) is None:
                    self.problem(t, f"{phase}: gap: no record of version {v} (head {head})")
                    continue
                self.check_version(t, phase, store, oracle, v)
            if orphans:
                self.check_orphans(t, phase, self.loc.files(t.dir))
        except Exception as exc:  # a check that cannot even run is a finding too
            self.problem(t, f"{phase}: {type(exc).__name__}: {str(exc)[:800]}")
        after = self.outside(t.dir)
        if after != t.outside_before:
            self.problem(t, f"{phase}: outside the store: +{sorted(after - t.outside_before)} "
                            f"-{sorted(t.outside_before - after)}")  # fmt: skip

    def check_version(self, t: Trial, phase: str, store: Any, oracle: Oracle, v: int) -> None:
        import dynstate

        rec = oracle.record(v)
        assert rec is not None
        want = oracle.table(v)
        if want.num_rows != rec["num_rows"]:
            self.problem(t, f"{phase}: v{v}: shards hold {want.num_rows} rows, record says "
                            f"{rec['num_rows']}")  # fmt: skip
        rows = want.to_pylist()
        got = store.snapshot(v).to_arrow().replace_schema_metadata(None).to_pylist()
        if got != rows:
            self.problem(t, f"{phase}: v{v}: snapshot().to_arrow() != shards read whole")
        n = len(rows)
        if n:
            idx = [n - 1, 0, n // 2, 0, n - 1, min(1, n - 1), n // 3]
            ds = dynstate.VersionedDataset(store, version=v)
            if ds.read_batch(idx) != [rows[i] for i in idx]:
                self.problem(t, f"{phase}: v{v}: read_batch({idx}) != oracle")
            if ds[n - 1] != rows[n - 1]:
                self.problem(t, f"{phase}: v{v}: ds[{n - 1}] != oracle")
        outs, gen, cons = self.expected(oracle, v)
        stats = store.outcome_stats(v).to_pydict()
        want_fold = fold(outs)
        got_fold = {
            r: (a, m)
            for r, a, m in zip(stats["row"], stats["attempts"], stats["mean_score"], strict=True)
            if a
        }
        if set(got_fold) != set(want_fold) or any(
            got_fold[r][0] != want_fold[r][0] or not math.isclose(got_fold[r][1], want_fold[r][1])
            for r in want_fold
        ):
            self.problem(t, f"{phase}: v{v}: outcome_stats {got_fold} != fold {want_fold}")
        if len(stats["row"]) != n:
            self.problem(t, f"{phase}: v{v}: outcome_stats has {len(stats['row'])} rows, not {n}")
        recs = store.outcome_records(v).to_pydict()
        got_recs = Counter(
            zip(recs.get("row", []), recs.get("step", []), recs.get("score", []), strict=True)
        )
        want_recs = Counter((o["row"], o["step"], float(o["score"])) for o in outs)
        if got_recs != want_recs:
            self.problem(t, f"{phase}: v{v}: outcome_records {got_recs} != {want_recs}")
        if store.generator_state(v) != gen:
            self.problem(t, f"{phase}: v{v}: generator_state {store.generator_state(v)} != {gen}")
        got_cons = len(dynstate.consumption_records(store, v))
        if got_cons != cons:
            self.problem(t, f"{phase}: v{v}: {got_cons} consumption records, expected {cons}")

    def check_orphans(self, t: Trial, phase: str, files: Any) -> None:
        named = b"".join(
            files.get(rel) or b"" for rel in files.list("_dynstate/") if rel.endswith(".json")
        ).decode(errors="replace")
        left = [rel for rel in files.list("data/") if rel.split("/")[-1] not in named]
        if left:
            self.problem(t, f"{phase}: after gc at grace 0 (clock +8 days) files no record "
                            f"names are left in data/: {left}")  # fmt: skip
        leases = files.list("_dynstate/leases/")
        if leases:
            self.problem(t, f"{phase}: lease files left after gc: {leases}")


# --------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(autouse=True)
def _no_kept_tables() -> Any:
    """The parent prepares the template: its kept tables of that round (dynstate.fresh) must
    not answer reads of the copies — every read here comes from the files."""
    from dynstate import fresh

    bound = fresh.FRESH.max_bytes
    fresh.FRESH.max_bytes = 0
    fresh.FRESH.clear()
    yield
    fresh.FRESH.max_bytes = bound


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    from dynstate import fresh

    fresh.FRESH.max_bytes = 0
    base = tmp_path_factory.mktemp("crash-template")
    return make_template(str(base / "store"))


@contextlib.contextmanager
def _harness(
    name: str, base: Path, template: Template, loc: Any = None, points: int = 0
) -> Iterator[Harness]:
    h = Harness(base, template, _ops(template)[name], loc, points)
    try:
        yield h
    finally:
        h.close()


def _run_op(h: Harness) -> Harness:
    base = h.base
    dry = h.dry_run()
    # the dry run itself must leave a consistent store
    t = Trial({"thread": "none", "k": 0}, base / "dry", outside_before=h.outside(base / "dry"))
    t.child = {"rc": 0}
    t.verify = h.verify_cli(base / "dry")
    h.check_trial(t, rerun=False)
    points = h.points(dry)
    trials = h.sweep(points)
    killed = sum(t.killed for t in trials)
    assert killed >= min(len(points) - 3, 10), [
        (t.point, t.child and t.child["rc"]) for t in trials
    ]
    return h


@pytest.fixture(scope="module")
def template99(tmp_path_factory: pytest.TempPathFactory) -> Template:
    from dynstate import fresh

    fresh.FRESH.max_bytes = 0
    base = tmp_path_factory.mktemp("crash-template99")
    return make_template(str(base / "store"), extra=99 - TEMPLATE_HEAD)


# The suite runs the commit kinds whose work differs most; DYNSTATE_CRASH_ALL=1 runs every
# variant (compact at version 100, the S3 runs), with the dense points above for a soak.
ALL = os.environ.get("DYNSTATE_CRASH_ALL") == "1"
only_with_all = pytest.mark.skipif(not ALL, reason="a soak's variant: DYNSTATE_CRASH_ALL=1")


@pytest.mark.parametrize("op", ["append_outcomes", pytest.param("compact", marks=only_with_all)])
def test_kill_at_every_line_checkpoint_version(
    op: str, template99: Template, tmp_path: Path
) -> None:
    """The commit of version 100 also writes its checkpoint, chunks and outcome checkpoint
    (every 100th version, docs/format.md): work after the commit that a kill may cut short."""
    with _harness(op, tmp_path, template99, points=10) as h:
        _run_op(h)
    assert not h.problems, "\n".join(h.problems[:30])


OPS = ["append", "append_outcomes", "compact", "gc", "reset", "rollback", "tag", "tag_force",
       "staged", "dynsamp"]  # fmt: skip


@pytest.mark.parametrize("op", OPS)
def test_kill_at_every_line(op: str, template: Template, tmp_path: Path) -> None:
    with _harness(op, tmp_path, template) as h:
        _run_op(h)
    assert not h.problems, "\n".join(h.problems[:30])


@only_with_all
@pytest.mark.parametrize("op", ["append", "append_outcomes"])
def test_kill_at_every_line_s3(op: str, s3_endpoint: str, tmp_path: Path) -> None:
    """The same kills on S3 (the loopback moto server of tests/conftest.py)."""
    from conftest import S3_BUCKET, s3_url

    from dynstate import fresh

    fresh.FRESH.max_bytes = 0
    template = make_template(s3_url())
    with _harness(op, tmp_path, template, S3Loc(S3_BUCKET), points=10) as h:
        _run_op(h)
    assert not h.problems, "\n".join(h.problems[:30])
