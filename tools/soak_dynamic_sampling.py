"""Kill soak for dynamic sampling (DAPO group filtering, SPEC §3.15): a filtering training loop
runs as a child process and is SIGKILLed at random instants (sometimes paused with SIGSTOP
and continued first); each time the same child command is started again and resumes from
its checkpoint file (only a step number) and the store. After every child ends — killed or
done — the store and the child's log are audited:

- the exactly-once equation on the head's lineage: per step ``carried_in + drawn == trained
  + filtered + dropped + carry`` and over the run ``drawn == trained + filtered + dropped +
  the last step's carry`` (multisets of row ids); each step's ``carried_in`` is the previous
  step's ``carry`` and a carried group is trained or carried again at the next step; the
  filtering replayed in plain Python from the drawn rows and the scoring function (which
  groups are filtered, trained, carried or dropped, with their scores),
- no row drawn twice within an epoch (no selection policy, so nothing repeats): the drawn
  stream cut into epochs of the pinned versions' sizes, each complete epoch the pinned
  version's rows exactly once, the records' (epoch, position) where the stream says,
- every step of the lineage and every step the child logged (the rows drawn, the groups
  trained with their scores, the carry) equals the uninterrupted reference run's step,
  which a child without kills and without loader workers computes once at the start,
- the resume: the child continued at the checkpoint's step + 1, after rolling the store back
  to exactly that step, and its steps follow without a gap,
- a plain oracle: each trained group's item (``id``) equals that row of its version read
  with pyarrow directly (the version's shard files read whole, then ``take``).

Where a kill lands: about 15% of the children are killed while they start (imports, opening
or making the store, the resume's rollback), 75% a random instant into one of their first
steps after the resume, and the rest run to their end; about 30% are first paused a while
with SIGSTOP/SIGCONT. The child is stopped before its kill, and the phase its log names then
(start, resume, draw, train, commit, checkpoint, done) is counted in the summary.

Each trial starts a fresh store and runs ``--steps`` steps through kills; trials repeat
until ``--seconds`` are spent (the child running then is killed and audited too). Loader
workers: ``--workers 0`` or ``2``; by default each child takes the other of the two, so
resumes change the number of workers (the reference has none). Exit status 1 on any
violation (or a child that fails on its own), 0 otherwise.

    python tools/soak_dynamic_sampling.py --seconds 300
    python tools/soak_dynamic_sampling.py --seconds 300 --workers 2 --surplus drop
    python tools/soak_dynamic_sampling.py --seconds 300 --s3    # loopback S3 (moto)

With ``--s3`` the store lives on a loopback moto server in this process
(``tools/loopback_s3.py``; moto is a test dependency), the children reach it through the
standard AWS variables and the oracle reads the shards from it with fsspec.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GROUP = 4  # responses per prompt: a group's scores
# The child's phases, in order (its log names the one it is in; see Log.phase).
PHASES = ("start", "resume", "draw", "train", "commit", "checkpoint", "done")


class Violation(AssertionError):
    """An audit found the store or a child's steps other than they must be."""


# -- the loop (child process) ------------------------------------------------------------------


def scores_of(row_id: int, step: int) -> list[float]:
    """The fake policy's rewards: a pure function of (row id, step), so that a resumed step
    scores exactly as the uninterrupted run's. About a third of the groups are made all-equal
    (filtered by zero variance) and a few more come out all-equal by chance."""
    x = (row_id * 2654435761 + step * 40503 + 12345) % (1 << 32)
    if x % 3 == 0:
        return [float(x >> 8 & 1)] * GROUP
    return [float(x >> (8 + k) & 1) for k in range(GROUP)]


def round_rows(step: int) -> list[dict[str, Any]]:
    """The rows the round of ``step`` adds (0 to 2), so later epochs pin larger versions."""
    return [{"id": 1000 * (step + 1) + k} for k in range(step % 3)]


class Log:
    """The child's log: one JSON object a line, each written with one unbuffered write() on an
    O_APPEND file, so that a line is in the file once the call returns and a kill tears at
    most the line being written (the parent skips a torn line)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **entry: Any) -> None:
        os.write(self.fd, (json.dumps({**entry, "t": time.time()}) + "\n").encode())

    def phase(self, name: str, step: int | None = None) -> None:
        # Written when a phase begins: the last phase line is what the child is doing, which
        # the parent reads (the child stopped) just before it kills.
        self.write(phase=name, step=step)


def child_main(cfg: dict[str, Any]) -> None:
    """One run of the loop: build the store if empty, resume from the checkpoint file's step
    (None: no checkpoint yet), then per step draw and score, log what it trains, commit the
    round with outcomes and consumption, and every ``ckpt_every`` steps write the
    checkpoint — only the step — atomically."""
    log = Log(cfg["log"])
    log.phase("start")
    from dynstate import (
        DynamicSampling,
        Store,
        VersionedDataset,
        VersionedSampler,
        consumption_records,
        decode_index,
    )

    url, ckpt = cfg["url"], Path(cfg["ckpt"])
    store = Store.open(url, create=True)
    if store.head == 0:  # empty (also when a child was killed before its first commit)
        store.append([{"id": i} for i in range(cfg["rows"])])
    dataset = VersionedDataset(url)
    dyn = DynamicSampling(
        dataset,
        VersionedSampler(dataset, seed=cfg["seed"]),
        gen_batch_size=cfg["gen_batch_size"],
        train_groups=cfg["train_groups"],
        rule="zero_variance",
        max_gen_batches=cfg["max_gen_batches"],
        surplus=cfg["surplus"],
        num_workers=cfg["workers"],
    )
    at = json.loads(ckpt.read_text())["step"] if ckpt.exists() else None
    log.phase("resume", at)
    start = dyn.resume(at)
    # What the rollback left: the parent checks that the lineage ends at the checkpoint.
    steps = [r["step"] for r in consumption_records(Store.open(url))]
    log.write(resumed=start, checkpoint=at, lineage_last=steps[-1] if steps else None)
    for step in range(start, cfg["steps"]):
        log.phase("draw", step)
        drawn: list[int] = []

        def score(items: list[dict[str, Any]], at: int, drawn: list[int] = drawn) -> Any:
            drawn.extend(item["id"] for item in items)
            return [scores_of(item["id"], at) for item in items]

        batch = dyn.next_batch(step, score)
        log.phase("train", step)
        trained = []
        for g in batch.groups:
            version, row = decode_index(g.index)
            trained.append([version, row, g.item["id"]])
        log.write(
            step=step,
            drawn=drawn,
            trained=trained,
            scores=[list(g.scores) for g in batch.groups],
            carry=[g.item["id"] for g in dyn.carry],
            full=batch.full,
        )
        log.phase("commit", step)
        store.append(
            round_rows(step),
            meta={"step": step},
            outcomes=batch.outcomes(),
            rows_version=batch.rows_version,
            consumption=batch.record,
        )
        if (step + 1) % cfg["ckpt_every"] == 0:
            log.phase("checkpoint", step)
            tmp = ckpt.with_name(ckpt.name + ".tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ckpt)  # the checkpoint names a step whose round is committed
    log.phase("done")


# -- reading what the children left ----------------------------------------------------------


def read_log(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # torn by the kill, or still being written
    return out


def step_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A logged step as comparable with the reference's: versions are left out (a rollback's
    reset shifts version numbers; row numbers and ids stay)."""
    return {
        "step": entry["step"],
        "drawn": entry["drawn"],
        "trained": [[row, rid] for _, row, rid in entry["trained"]],
        "scores": entry["scores"],
        "carry": entry["carry"],
        "full": entry["full"],
    }


class Oracle:
    """Rows the plain way: a version's shards as its manifest lists them, each file read whole
    with pyarrow (bytes through fsspec, not through dynstate's readers), concatenated."""

    def __init__(self, url: str) -> None:
        import fsspec

        if url.startswith("s3://"):
            endpoint = os.environ["AWS_ENDPOINT_URL"]
            self.fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint})
        else:
            self.fs = fsspec.filesystem("file")
        self.root = url.rstrip("/")
        self.files: dict[str, Any] = {}  # shard path -> table: shards never change

    def table(self, store: Any, version: int) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        snap = store.snapshot(version)
        parts = []
        for shard in snap.shards:
            if shard.path not in self.files:
                data = self.fs.cat_file(f"{self.root}/{shard.path}")
                self.files[shard.path] = pq.read_table(pa.BufferReader(data))
            parts.append(self.files[shard.path])
        if not parts:
            return pa.table({"id": pa.array([], pa.int64())})
        return pa.concat_tables(parts, promote_options="default").select(["id"])

    def ids(self, store: Any, version: int, rows: list[int]) -> list[int]:
        """The ``id`` of each of ``rows`` of ``version``: the table read whole, then take."""
        import pyarrow as pa

        taken = self.table(store, version).take(pa.array(rows, pa.int64()))
        return [int(x) for x in taken.column("id").to_pylist()]


@dataclass
class Lineage:
    """The head lineage's consumption records, row numbers turned into row ids."""

    records: list[dict[str, Any]]
    ids: list[int]  # the head's rows' ids (the oracle's): row r of any lineage version


def lineage_of(url: str, oracle: Oracle) -> Lineage:
    from dynstate import Store, consumption_records

    store = Store.open(url)
    head = store.refresh()
    ids = oracle.ids(store, head, list(range(store.snapshot(head).num_rows)))
    records = []
    # Row r of any version on the lineage is row r of the head (rows are only appended, and
    # a rollback's reset keeps a prefix), so the head's ids name every record's rows.
    for rec in consumption_records(store):
        records.append(
            {
                "step": rec["step"],
                "gen_batches": rec["gen_batches"],
                "carried_in": [ids[r] for r in rec["carried_in"]],
                "drawn": [ids[r] for r in rec["drawn"]],
                "trained": [ids[r] for r in rec["trained"]],
                "filtered": [[ids[r], s] for r, s in rec["filtered"]],
                "dropped": [[ids[r], why] for r, why in rec["dropped"]],
                "carry": [[ids[r], s] for r, s in rec["carry"]],
                "epoch": rec["sampler"]["epoch"],
                "position": rec["sampler"]["position"],
                "base_rows": rec["sampler"]["base_rows"],
            }
        )
    return Lineage(records, ids)


# -- the audit ---------------------------------------------------------------------------------


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Violation(what)


def audit_equation(records: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    """The exactly-once equation over the lineage, and the filtering replayed in plain Python
    from each step's drawn rows and ``scores_of``."""
    check(
        [r["step"] for r in records] == list(range(len(records))),
        f"the lineage's steps are not 0..N each once: {[r['step'] for r in records]}",
    )
    total: dict[str, Counter[int]] = {k: Counter() for k in ("drawn", "trained", "dropped")}
    total["filtered"] = Counter()
    carry: list[list[Any]] = []  # [id, scores] the replay carries into the next step
    for r in records:
        step = r["step"]
        check(
            r["carried_in"] == [rid for rid, _ in carry],
            f"step {step}: carried in {r['carried_in']}, the step before carried "
            f"{[rid for rid, _ in carry]}",
        )
        filtered, dropped = [rid for rid, _ in r["filtered"]], [rid for rid, _ in r["dropped"]]
        out_carry = [rid for rid, _ in r["carry"]]
        check(
            Counter(r["carried_in"]) + Counter(r["drawn"])
            == Counter(r["trained"]) + Counter(filtered) + Counter(dropped) + Counter(out_carry),
            f"step {step}: carried_in + drawn != trained + filtered + dropped + carry",
        )
        # A carried group is trained, or (more carried than a batch holds) carried again.
        check(
            not Counter(r["carried_in"]) - (Counter(r["trained"]) + Counter(out_carry)),
            f"step {step}: a carried-in group was neither trained nor carried again",
        )
        # The plain replay: carried groups first, then the kept drawn ones in draw order.
        accepted = [list(g) for g in carry]
        want_filtered = []
        for rid in r["drawn"]:
            scores = scores_of(rid, step)
            if len(set(scores)) > 1:
                accepted.append([rid, scores])
            else:
                want_filtered.append([rid, 0.0])
        now, rest = accepted[: cfg["train_groups"]], accepted[cfg["train_groups"] :]
        check(
            r["filtered"] == want_filtered,
            f"step {step}: filtered {r['filtered']}, the replay {want_filtered}",
        )
        check(
            r["trained"] == [rid for rid, _ in now],
            f"step {step}: trained {r['trained']}, the replay {[rid for rid, _ in now]}",
        )
        if cfg["surplus"] == "carry":
            want_carry, want_dropped = rest, []
        else:
            want_carry, want_dropped = [], [[rid, "surplus"] for rid, _ in rest]
        check(r["carry"] == want_carry, f"step {step}: carry {r['carry']}, replay {want_carry}")
        check(r["dropped"] == want_dropped, f"step {step}: dropped {r['dropped']}, replay {rest}")
        carry = want_carry
        total["drawn"].update(r["drawn"])
        total["trained"].update(r["trained"])
        total["filtered"].update(filtered)
        total["dropped"].update(dropped)
    out = total["trained"] + total["filtered"] + total["dropped"] + Counter(rid for rid, _ in carry)
    check(
        total["drawn"] == out,
        "over the lineage: drawn != trained + filtered + dropped + the last step's carry "
        f"(drawn, not accounted for: {dict(total['drawn'] - out)}; accounted for, not drawn: "
        f"{dict(out - total['drawn'])})",
    )


def audit_epochs(lineage: Lineage) -> tuple[int, int]:
    """No row drawn twice within an epoch: the drawn stream, cut into epochs of the sizes the
    records name, holds each row of an epoch's pinned version at most once (exactly once in a
    complete epoch), and every record's (epoch, position) is where the stream says. Returns
    (epochs completed, rows drawn)."""
    records = lineage.records
    sizes: dict[int, int] = {}
    for r in records:
        if sizes.setdefault(r["epoch"], r["base_rows"]) != r["base_rows"]:
            raise Violation(f"epoch {r['epoch']} has two sizes in the records")
    epoch, pos, complete, drawn = 0, 0, 0, 0
    seen: set[int] = set()
    for r in records:
        for rid in r["drawn"]:
            if pos == sizes.get(epoch):  # the epoch is over: the next one begins
                check(
                    seen == set(lineage.ids[: sizes[epoch]]),
                    f"epoch {epoch} did not draw each of its {sizes[epoch]} rows once",
                )
                epoch, pos, seen, complete = epoch + 1, 0, set(), complete + 1
            check(epoch in sizes, f"step {r['step']} draws in epoch {epoch}, which no record has")
            check(rid not in seen, f"row id {rid} drawn twice in epoch {epoch} (step {r['step']})")
            check(
                rid in lineage.ids[: sizes[epoch]],
                f"row id {rid} (step {r['step']}) is not a row of epoch {epoch}'s version",
            )
            seen.add(rid)
            pos += 1
            drawn += 1
        check(
            (r["epoch"], r["position"]) == (epoch, pos),
            f"step {r['step']}: the record's position is epoch {r['epoch']} row {r['position']},"
            f" the drawn rows put it at epoch {epoch} row {pos}",
        )
    return complete, drawn


@dataclass
class Reference:
    """The uninterrupted run: its lineage's records and every step it logged."""

    records: list[dict[str, Any]]
    steps: dict[int, dict[str, Any]]
    ids: list[int]
    step_s: float  # seconds per step
    start_s: float  # seconds from launch to the first step


# -- the soak (parent) ---------------------------------------------------------------------------


@dataclass
class Soak:
    workdir: Path
    cfg: dict[str, Any]
    rng: random.Random
    workers: int | None  # None: alternate 0 and 2
    s3: bool = False
    figures: Counter[str] = field(default_factory=Counter)
    kill_phases: Counter[str] = field(default_factory=Counter)
    workers_used: Counter[int] = field(default_factory=Counter)
    reference: Reference | None = None
    children: int = 0
    high: dict[str, int] = field(default_factory=dict)  # store -> the highest step run
    totals: dict[str, int] = field(default_factory=dict)  # the reference's

    def url(self, name: str) -> str:
        if self.s3:
            return f"s3://dynstate-soak/{name}"
        return str(self.workdir / name)

    def launch(self, url: str, ckpt: Path, log: Path, workers: int) -> subprocess.Popen[bytes]:
        """The child command: the same each time for a trial (but for the workers)."""
        self.children += 1
        cfg = {**self.cfg, "url": url, "ckpt": str(ckpt), "log": str(log), "workers": workers}
        err = open(self.workdir / f"child-{self.children}.err", "wb")  # noqa: SIM115
        # Its own process group, so that a kill takes the loader's workers with it, as a
        # node's failure would.
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(cfg)],
            stdout=err,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        err.close()
        return proc

    def err_tail(self) -> str:
        return (self.workdir / f"child-{self.children}.err").read_text(errors="replace")[-3000:]

    def run_reference(self) -> Reference:
        """One uninterrupted run, without workers: what every step must equal."""
        url, log = self.url("reference"), self.workdir / "reference.jsonl"
        began = time.time()
        proc = self.launch(url, self.workdir / "reference-ckpt.json", log, 0)
        if proc.wait() != 0:
            raise Violation(f"the reference run failed: {self.err_tail()}")
        entries = read_log(log)
        steps = {e["step"]: step_entry(e) for e in entries if "drawn" in e}
        check(sorted(steps) == list(range(self.cfg["steps"])), "the reference missed steps")
        lineage = lineage_of(url, Oracle(url))
        audit_equation(lineage.records, self.cfg)
        epochs, _ = audit_epochs(lineage)
        # Not vacuous: the run filters, refills, carries or drops, and crosses epochs.
        recs = lineage.records
        self.totals = {
            "drawn": sum(len(r["drawn"]) for r in recs),
            "filtered": sum(len(r["filtered"]) for r in recs),
            "carried": sum(len(r["carry"]) for r in recs),
            "dropped": sum(len(r["dropped"]) for r in recs),
            "refills": sum(r["gen_batches"] - 1 for r in recs),
            "epochs": epochs,
        }
        surplus = self.totals["carried" if self.cfg["surplus"] == "carry" else "dropped"]
        check(
            self.totals["filtered"] > 0 and self.totals["refills"] > 0 and surplus > 0
            and epochs > 1,
            f"the reference run exercises too little to audit: {self.totals}",
        )  # fmt: skip
        times = [e["t"] for e in entries if e.get("phase") == "draw"]
        step_s = (times[-1] - times[0]) / max(1, len(times) - 1)
        return Reference(lineage.records, steps, lineage.ids, step_s, times[0] - began)

    def trial(self, number: int, deadline: float) -> bool:
        """Run one store's ``steps`` steps through kills until done or the deadline; True
        when the run completed."""
        name = f"trial-{number}"
        url, ckpt = self.url(name), self.workdir / f"{name}-ckpt.json"
        oracle = Oracle(url)
        while True:
            self.figures["children"] += 1
            workers = self.workers if self.workers is not None else 2 * (self.children % 2)
            self.workers_used[workers] += 1
            at = json.loads(ckpt.read_text())["step"] if ckpt.exists() else None
            self.figures["resumes" if at is not None else "fresh_starts"] += 1
            log = self.workdir / f"{name}-child-{self.children + 1}.jsonl"
            proc = self.launch(url, ckpt, log, workers)
            finished = self.drive(proc, log, deadline)
            self.audit(url, oracle, log, at, finished)
            if finished:
                self.figures["trials_completed"] += 1
                return True
            if time.monotonic() >= deadline:
                return False

    def drive(self, proc: subprocess.Popen[bytes], log: Path, deadline: float) -> bool:
        """Let the child run, pause it now and then, and kill it at a random instant: while
        it starts (imports, resume and rollback) or some steps into its run, a random time
        into a step. True when it ran to its end."""
        assert self.reference is not None
        ref = self.reference
        kill_at: float | None = None
        after_steps: int | None = None
        u = self.rng.random()
        if u < 0.15:  # during the start: imports, opening, the resume's rollback
            kill_at = time.monotonic() + self.rng.uniform(0, 1.2 * ref.start_s)
        elif u < 0.9:  # after some steps, at any instant within a step
            after_steps = self.rng.randint(0, 3 * self.cfg["ckpt_every"])
        # else: let it run to the end
        pause_at = time.monotonic() + self.rng.uniform(0, ref.start_s + 3 * ref.step_s)
        pause_pending = self.rng.random() < 0.3
        while proc.poll() is None:
            now = time.monotonic()
            if kill_at is None and after_steps is not None:
                begun = sum(1 for e in read_log(log) if e.get("phase") == "draw")
                if begun > after_steps:  # step number after_steps of this run has begun
                    kill_at = now + self.rng.uniform(0, 1.5 * ref.step_s)
            if pause_pending and now >= pause_at:
                # SIGSTOP the whole group a while: a stalled node, a swapped-out process.
                pause_pending = False
                try:
                    os.killpg(proc.pid, signal.SIGSTOP)
                    time.sleep(self.rng.uniform(0.05, 0.8))
                    os.killpg(proc.pid, signal.SIGCONT)
                    self.figures["pauses"] += 1
                except ProcessLookupError:
                    pass  # it ended meanwhile
            if now >= deadline and kill_at is None:
                kill_at = now
            if kill_at is not None and now >= kill_at:
                return not self.kill(proc, log)
            time.sleep(0.005)
        if proc.returncode != 0:
            raise Violation(
                f"a child failed on its own (exit {proc.returncode}): {self.err_tail()}"
            )
        return True

    def kill(self, proc: subprocess.Popen[bytes], log: Path) -> bool:
        """SIGKILL the child's group; False when it had ended by itself. It is stopped first,
        so that the phase its log names is the one it dies in."""
        try:
            os.killpg(proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        entries = read_log(log)
        phases = [e for e in entries if "phase" in e]
        phase = phases[-1]["phase"] if phases else "start"
        if proc.poll() is not None:  # it ended before the signal: no kill
            if proc.returncode != 0:
                raise Violation(f"a child failed on its own: {self.err_tail()}")
            return False
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.figures["kills"] += 1
        self.kill_phases[phase] += 1
        return True

    def audit(self, url: str, oracle: Oracle, log: Path, at: int | None, finished: bool) -> None:
        """What one child left, against the reference and the oracle."""
        from dynstate import Store, StoreNotFoundError

        assert self.reference is not None
        ref = self.reference
        self.figures["audits"] += 1
        entries = read_log(log)
        # The resume: where it continued, and the rollback to exactly the checkpoint's step.
        resumed = [e for e in entries if "resumed" in e]
        if resumed:
            r = resumed[0]
            want = 0 if at is None else at + 1
            check(r["checkpoint"] == at, f"the child read checkpoint {r['checkpoint']}, not {at}")
            check(r["resumed"] == want, f"resumed at step {r['resumed']}, not {want}")
            check(
                r["lineage_last"] == at,
                f"after resume({at}) the lineage ends at step {r['lineage_last']}",
            )
        # Every step it ran equals the uninterrupted run's, without a gap after the resume.
        ran = [e for e in entries if "drawn" in e]
        if ran:
            check(
                [e["step"] for e in ran] == list(range(ran[0]["step"], ran[0]["step"] + len(ran))),
                f"the child's steps are not consecutive: {[e['step'] for e in ran]}",
            )
            check(resumed != [] and ran[0]["step"] == resumed[0]["resumed"], "steps before resume")
        for e in ran:
            step = e["step"]
            check(
                step_entry(e) == ref.steps[step],
                f"step {step} after resume({at}) differs from the uninterrupted run's:\n"
                f"  got  {step_entry(e)}\n  want {ref.steps[step]}",
            )
            self.figures["steps_run"] += 1
            self.figures["steps_run_again"] += step <= self.high.get(url, -1)
            self.high[url] = max(step, self.high.get(url, -1))
        try:
            store = Store.open(url)
        except StoreNotFoundError:
            # Killed before the store was made: then it cannot have run a step.
            check(not ran, f"steps {[e['step'] for e in ran]} ran, but there is no store")
            return
        # The plain oracle: each trained item is the row of its version, read with pyarrow.
        by_version: dict[int, list[tuple[int, int]]] = {}
        for e in ran:
            for version, row, rid in e["trained"]:
                by_version.setdefault(version, []).append((row, rid))
        for version, pairs in by_version.items():
            got = oracle.ids(store, version, [row for row, _ in pairs])
            want_ids = [rid for _, rid in pairs]
            check(
                got == want_ids,
                f"trained items are not the oracle's rows of version {version}: {want_ids} vs "
                f"{got}",
            )
            self.figures["items_checked_by_oracle"] += len(pairs)
        # The store: the lineage is a prefix of the reference's, and exactly once.
        if store.head == 0:
            return  # killed before the first commit
        lineage = lineage_of(url, oracle)
        n = len(lineage.records)
        # The equation first: it holds on any lineage, whatever the reference says.
        audit_equation(lineage.records, self.cfg)
        epochs, _ = audit_epochs(lineage)
        self.figures["equation_audits"] += 1
        self.figures["max_epochs_completed"] = max(self.figures["max_epochs_completed"], epochs)
        check(n <= len(ref.records), "the lineage has more steps than the run")
        check(at is None or n > at, f"the lineage lost step {at}, which a checkpoint names")
        for got_rec, want_rec in zip(lineage.records, ref.records, strict=False):
            check(
                got_rec == want_rec,
                f"step {got_rec['step']}'s record differs from the uninterrupted run's:\n"
                f"  got  {got_rec}\n  want {want_rec}",
            )
        check(
            lineage.ids == ref.ids[: len(lineage.ids)],
            "the head's rows are not a prefix of the reference's",
        )
        if finished:
            check(n == self.cfg["steps"], f"a finished run's lineage holds {n} steps")
            check(lineage.ids == ref.ids, "a finished run's rows differ from the reference's")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--workers", type=int, choices=(0, 2), help="default: alternate 0 and 2")
    parser.add_argument("--surplus", choices=("carry", "drop"), default="carry")
    parser.add_argument("--steps", type=int, default=30, help="steps of one trial's run")
    parser.add_argument("--s3", action="store_true", help="the store on loopback S3 (moto)")
    parser.add_argument("--keep", type=Path, help="keep the stores and logs in this folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child_main(json.loads(args.child))
        return 0
    cfg = {
        "rows": 29,
        "steps": args.steps,
        "seed": args.seed % 1000,
        "gen_batch_size": 4,
        "train_groups": 5,
        "max_gen_batches": 3,
        "surplus": args.surplus,
        "ckpt_every": 3,
    }
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=False)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dynstate-dynsoak-") as tmp:
        workdir = args.keep if args.keep is not None else Path(tmp)
        soak = Soak(workdir, cfg, random.Random(args.seed), args.workers, s3=args.s3)
        trials, problem = 0, None
        with contextlib.ExitStack() as stack:
            if args.s3:
                sys.path.insert(0, str(HERE))
                from loopback_s3 import loopback_s3

                # AWS_* point at it while it runs: the children inherit them.
                stack.enter_context(loopback_s3("dynstate-soak"))
            try:
                soak.reference = soak.run_reference()
                deadline = began + args.seconds
                while time.monotonic() < deadline:
                    trials += 1
                    soak.trial(trials, deadline)
            except Violation as exc:
                problem = str(exc)
    f = soak.figures
    ref = soak.reference
    phases = {p: soak.kill_phases[p] for p in PHASES if soak.kill_phases[p]}
    print(
        f"dynamic sampling soak, {'s3' if args.s3 else 'local'}, seed {args.seed}, "
        f"surplus={args.surplus}, workers {dict(soak.workers_used)}, "
        f"{time.monotonic() - began:.0f}s:\n"
        f"  reference: {args.steps} steps, "
        + (f"{ref.step_s * 1000:.0f} ms a step, {ref.start_s:.1f}s to start, " if ref else "")
        + f"{soak.totals}\n"
        + f"  {trials} trials ({f['trials_completed']} run to the end), {f['children']} "
        f"children: {f['fresh_starts']} fresh starts, {f['resumes']} resumes\n"
        f"  {f['kills']} SIGKILLs by phase {phases}, {f['pauses']} SIGSTOP pauses\n"
        f"  {f['audits']} audits ({f['equation_audits']} of the equation on a lineage), "
        f"{f['steps_run']} steps run ({f['steps_run_again']} again after a resume) each equal "
        f"to the reference's, {f['items_checked_by_oracle']} trained items checked by the "
        f"oracle, up to {f['max_epochs_completed']} epochs completed\n"
        f"  violations: {0 if problem is None else 1}"
    )
    if problem is not None:
        print(f"FAILED (seed {args.seed}): {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
