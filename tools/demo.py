"""The README's demo: a verl-style curriculum run with dynamic data generation that is killed
with SIGKILL and resumed.

    python tools/demo.py --dir demo-out [--s3] [--steps N] [--seed S] [--workers N]
    bash tools/demo.sh                  # sets up .venv first, then runs this

It runs from a checkout (it is not part of the installed package) and uses dynstate as a user
would: the library for the training loop, the ``dynstate`` command for ``ls``, ``stats`` and
``plot``.

Arithmetic tasks go into a store. A stand-in policy scores each task of a batch 1 or 0, solving
a task with a probability that falls with its answer and rises with the step (a deterministic
function of the seed, the row and the step, so a resumed run scores exactly as the
uninterrupted one); the scores are committed per row as the round's outcomes, and the sampler
draws rows by :class:`dynstate.Learnability` over them (the rows the policy solves
sometimes, not always or never). A rule-based generator
commits variations of the failed tasks as one round per step. The training loop uses
torchdata's real ``StatefulDataLoader`` with :class:`VersionedDataset` and
:class:`VersionedSampler` and saves ``{"loader": loader.state_dict(), "step": s}`` every few
steps, as verl's ``data.pt``.

The same loop runs in subprocesses: once uninterrupted on a reference store, once on the
run's store until it is SIGKILLed at a seeded step, then resumed from its last checkpoint in a
fresh process (``rollback`` + ``loader.load_state_dict``). The demo checks that the batches,
the outcomes and the final head equal the reference's, prints both runs' batches side by side
for the steps after the checkpoint as evidence, then the pass rate per step and ``dynstate
stats``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from dynstate import DynstateError, InvalidDataError, Store, StoreExistsError, lineage, rollback

log = logging.getLogger("dynstate")

GENERATOR = "variations-v1"
MARKER = ".dynstate-demo"
HERE = os.path.dirname(os.path.abspath(__file__))
S3_BUCKET = "dynstate-demo"
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("a", pa.int64()),
        ("b", pa.int64()),
        ("answer", pa.int64()),
        ("origin_step", pa.int64()),  # -1: the initial import
        # The reserved lineage column: the row numbers a task was derived from (null for the
        # import), which `dynstate serve` follows to show a row's ancestors and descendants.
        ("_dynstate_source", pa.list_(pa.int64())),
    ]
)
# Each batch row carries its number in the store under this key (VersionedDataset's
# row_column): what a generated task's _dynstate_source names.
ROW_KEY = "_dynstate_row"


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 60
    seed: int = 0
    workers: int = 2
    mode: str = "epoch"
    batch_size: int = 8
    initial_tasks: int = 64
    ckpt_every: int = 5
    max_new: int = 8  # variations per round
    step_time: float = 0.4  # the simulated policy update, seconds per step

    def check(self) -> None:
        if self.ckpt_every < 1 or self.steps < self.ckpt_every + 3:
            raise InvalidDataError(
                f"the demo needs steps >= checkpoint interval + 3 to crash after a checkpoint "
                f"(steps={self.steps}, every={self.ckpt_every}); pass a larger --steps"
            )
        if self.workers < 0 or self.batch_size < 1 or self.initial_tasks < self.batch_size:
            raise InvalidDataError(
                "the demo needs workers >= 0 and at least one batch of initial tasks"
            )

    @property
    def lag(self) -> int:
        # Fresh rows may only be drawn once their round is surely committed: beyond the
        # loader's prefetch depth (prefetch_factor is 1 here).
        return self.workers + 1


# -- the task world ----------------------------------------------------------------------------


def initial_tasks(cfg: DemoConfig) -> pa.Table:
    rng = random.Random(cfg.seed)
    rows = []
    for i in range(cfg.initial_tasks):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        rows.append(_task(f"t{i:04d}", a, b, -1, None))
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def _task(task_id: str, a: int, b: int, step: int, source: list[int] | None) -> dict[str, Any]:
    prompt = f"what is {a}+{b}?"
    return {"id": task_id, "prompt": prompt, "a": a, "b": b, "answer": a + b,
            "origin_step": step, "_dynstate_source": source}  # fmt: skip


def solve_chance(answer: int, step: int) -> float:
    """The stand-in policy's skill: the chance it solves a task falls with the task's answer
    and rises as it trains (even odds at 30 on step 0, at 120 on step 60)."""
    return 1.0 / (1.0 + math.exp((answer - 30 - 1.5 * step) / 6.0))


def score(task: dict[str, Any], step: int, cfg: DemoConfig) -> float:
    """What the stand-in policy scores on a batch row at a step: 1.0 (solved) or 0.0. A pure
    function of the seed, the row and the step, so that a resumed run scores every step as
    the uninterrupted run did."""
    draw = random.Random(f"policy-{cfg.seed}-{task[ROW_KEY]}-{step}").random()
    return 1.0 if draw < solve_chance(task["answer"], step) else 0.0


def generate(failed: list[dict[str, Any]], step: int, cfg: DemoConfig) -> pa.Table:
    """Two easier variations of each failed task (one operand made smaller), in batch order,
    at most ``cfg.max_new`` per round: deterministic, so a resumed run regenerates the same.
    Each names the store row it varies (the batch row's ``_dynstate_row``) as its source."""
    rows: list[dict[str, Any]] = []
    for task in failed:
        k = 1 + (31 * task["a"] + 17 * task["b"] + step + cfg.seed) % 9
        for a, b in ((max(1, task["a"] - k), task["b"]), (task["a"], max(1, task["b"] - k))):
            if len(rows) < cfg.max_new:
                source = [task[ROW_KEY]]
                rows.append(_task(f"g{step:04d}.{len(rows):02d}", a, b, step, source))
    return pa.Table.from_pylist(rows, schema=SCHEMA)


# -- the training process (runs in a subprocess) -----------------------------------------------


def _collate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return rows


def _latest_checkpoint(ckpt_dir: str) -> tuple[int, str] | None:
    """verl's convention: latest_checkpointed_iteration.txt names the newest complete one."""
    try:
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")) as fh:
            step = int(fh.read().strip())
    except FileNotFoundError:
        return None
    return step, os.path.join(ckpt_dir, f"global_step_{step}", "data.pt")


def _save_checkpoint(ckpt_dir: str, step: int, loader: Any) -> None:
    import torch

    path = os.path.join(ckpt_dir, f"global_step_{step}")
    os.makedirs(path, exist_ok=True)
    torch.save({"loader": loader.state_dict(), "step": step}, os.path.join(path, "data.pt.tmp"))
    os.replace(os.path.join(path, "data.pt.tmp"), os.path.join(path, "data.pt"))
    _write_atomic(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), str(step))


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def train(
    url: str,
    workdir: str,
    cfg: DemoConfig,
    *,
    resume: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The training loop. Appends one line per step to ``stream.jsonl`` (or
    ``stream-resumed.jsonl``): the step and the rows of its batch."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import Learnability, VersionedDataset, VersionedSampler

    store = Store.open(url, storage_options=storage_options)
    ckpt_dir = os.path.join(workdir, "ckpt")
    start, state = 0, None
    if resume:
        found = _latest_checkpoint(ckpt_dir)
        if found is None:
            raise InvalidDataError(f"no checkpoint in {ckpt_dir} to resume {url} from")
        ckpt_step, path = found
        ckpt = torch.load(path, weights_only=True)  # plain types only: no pickle
        # Rounds the crashed run committed after its checkpoint must not leak in.
        rollback(store, step=ckpt_step, meta={"reason": "demo resume"})
        start, state = ckpt_step + 1, ckpt["loader"]
    dataset = VersionedDataset(store, row_column=ROW_KEY)
    # The curriculum: rows weighted by p * (1 - p) of their pass rate p so far (untried rows
    # at 0.25), from the statistics of the version each epoch pinned (in mix mode, of the
    # round `lag` steps back): what the policy solves sometimes is drawn most.
    sampler = VersionedSampler(
        dataset,
        seed=cfg.seed,
        mode=cfg.mode,
        batch_size=cfg.batch_size,
        lag=cfg.lag,
        select=Learnability(),
    )
    loader = StatefulDataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.workers,
        collate_fn=_collate,
        **({"prefetch_factor": 1} if cfg.workers else {}),
    )
    if state is not None:
        loader.load_state_dict(state)
    name = "stream-resumed.jsonl" if resume else "stream.jsonl"
    step = start
    with open(os.path.join(workdir, name), "a") as stream:
        while step < cfg.steps:
            for batch in loader:
                scores = [score(task, step, cfg) for task in batch]
                failed = [task for task, s in zip(batch, scores, strict=True) if s == 0.0]
                time.sleep(cfg.step_time)
                new = generate(failed, step, cfg)
                # The step's scores, one per sample, committed with its round (the README's
                # recipe): the statistics the sampler's next weights come from.
                outcomes = {"row": [task[ROW_KEY] for task in batch],
                            "step": [step] * len(batch), "score": scores}  # fmt: skip
                store.append(new, meta={"step": step, "generator": GENERATOR}, outcomes=outcomes)
                if (step + 1) % cfg.ckpt_every == 0:
                    _save_checkpoint(ckpt_dir, step, loader)
                # Versions the sampler has read from so far (it runs ahead by the prefetch).
                read = sorted(
                    {v for v in (sampler.version, sampler.fresh_version) if v is not None}
                )
                line = {"step": step, "rows": batch, "scores": scores, "versions": read,
                        "new": new.num_rows}  # fmt: skip
                stream.write(json.dumps(line) + "\n")
                stream.flush()
                step += 1
                if step >= cfg.steps:
                    break


# -- the orchestrating process -----------------------------------------------------------------


def prepare_dir(path: str) -> str:
    """Empty ``path`` for a new demo; refuses a non-empty directory the demo did not make."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.exists(os.path.join(path, MARKER)):
            raise StoreExistsError(
                f"{path} is not empty and was not made by the dynstate demo; pass --dir with "
                "a new or empty directory"
            )
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MARKER), "w") as fh:
        fh.write("made by the dynstate demo; the next demo run deletes this directory\n")
    return path


def read_stream(path: str) -> list[dict[str, Any]]:
    """Steps a training process logged; a line cut short by SIGKILL is not a step."""
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1]]


class _Child:
    """One training process (``python tools/demo.py _train``) in its own process group, so
    the crash kills it together with its DataLoader workers, as a lost node would."""

    def __init__(
        self, url: str, workdir: str, cfg: DemoConfig, s3: Any = None, resume: bool = False
    ):
        os.makedirs(workdir, exist_ok=True)
        self.stream = os.path.join(workdir, "stream-resumed.jsonl" if resume else "stream.jsonl")
        self.log_path = os.path.join(workdir, "resumed.log" if resume else "train.log")
        args = {"url": url, "workdir": workdir, "cfg": asdict(cfg), "resume": resume}
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "_train", json.dumps(args)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=_child_env(s3),
            )

    def steps(self) -> int:
        return len(read_stream(self.stream))

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def failure(self, what: str) -> str:
        with open(self.log_path, errors="replace") as fh:
            tail = fh.read()[-2000:]
        return f"{what} exited with {self.proc.returncode}; its log ({self.log_path}):\n{tail}"


def pick_crash_step(cfg: DemoConfig) -> int:
    """A seeded step after the first checkpoint and not itself a checkpoint step, so the
    crashed run always leaves rounds behind that the resume must roll back."""
    steps = [s for s in range(cfg.ckpt_every, cfg.steps - 2) if (s + 1) % cfg.ckpt_every]
    return random.Random(f"crash-{cfg.seed}").choice(steps)


def compare(
    ref_dir: str, run_dir: str, ckpt_step: int, cfg: DemoConfig, run_store: Store | None = None
) -> str | None:
    """None if the crashed run's steps up to its checkpoint plus the resumed run's steps equal
    the reference's, batch by batch and row by row, and (given ``run_store``) read only
    versions of its head's lineage; else where they first differ."""
    reference = read_stream(os.path.join(ref_dir, "stream.jsonl"))
    before = [
        s for s in read_stream(os.path.join(run_dir, "stream.jsonl")) if s["step"] <= ckpt_step
    ]
    combined = before + read_stream(os.path.join(run_dir, "stream-resumed.jsonl"))
    if [s["step"] for s in combined] != list(range(cfg.steps)):
        return f"the run logged steps {[s['step'] for s in combined]}, expected 0..{cfg.steps - 1}"
    if run_store is not None:
        kept = set(lineage(run_store))
        for step in combined:
            gone = [v for v in step["versions"] if v not in kept]
            if gone:
                return (
                    f"step {step['step']}: the sampler read version(s) {gone}, which the "
                    "rollback abandoned: rounds of the crashed run leaked into the resumed run"
                )
    for ours, theirs in zip(combined, reference, strict=True):
        if ours["rows"] != theirs["rows"]:
            ids = [r["id"] for r in ours["rows"]], [r["id"] for r in theirs["rows"]]
            return f"step {ours['step']}: batch {ids[0]} but the reference had {ids[1]}"
        if ours.get("scores") != theirs.get("scores"):
            return f"step {ours['step']}: scores {ours['scores']} but the reference had " + str(
                theirs["scores"]
            )
    return None


def run_demo(
    out_dir: str = "demo-out", *, s3: bool = False, cfg: DemoConfig | None = None, console=None
) -> bool:
    """Run the demo; prints progress, the evidence, the verdict and ``dynstate ls``, writes
    growth.png and summary.json. Returns True when the resumed run equals the reference."""
    from rich.console import Console

    cfg = cfg or DemoConfig()
    cfg.check()
    console = console or Console(highlight=False, soft_wrap=True)
    out = prepare_dir(out_dir)
    with _s3_server() if s3 else contextlib.nullcontext() as server:
        options = _storage_options(server)
        base = f"s3://{S3_BUCKET}" if s3 else out
        urls = {"run": f"{base}/store", "reference": f"{base}/reference-store"}
        for url in urls.values():
            Store.open(url, create=True, storage_options=options).append(
                initial_tasks(cfg), meta={"step": -1, "generator": "initial"}
            )
        crash = pick_crash_step(cfg)
        console.print(
            f"dynstate demo: {cfg.initial_tasks} arithmetic tasks, {cfg.steps} steps of "
            f"{cfg.batch_size},\n  sampler mode {cfg.mode!r}, drawing by "
            "select=dynstate.Learnability() over the scores recorded as outcomes,\n"
            f"  DataLoader workers: {cfg.workers}, a checkpoint every {cfg.ckpt_every} steps\n"
            f"  store:     {urls['run']}\n"
            f"  reference: {urls['reference']}\n  the training run will be SIGKILLed "
            f"after step {crash}"
        )
        ckpt_step, lost = _crash_and_resume(urls, out, cfg, crash, console, server)
        dirs = [os.path.join(out, name) for name in ("reference", "run")]
        run_store = Store.open(urls["run"], storage_options=options)
        problem = compare(*dirs, ckpt_step, cfg, run_store)
        head = run_store.snapshot()
        ref_head = Store.open(urls["reference"], storage_options=options).snapshot()
        if problem is None and not head.to_arrow().equals(ref_head.to_arrow()):
            problem = f"head {head.num_rows} rows differs from the reference's {ref_head.num_rows}"
        records = run_store.outcome_records()
        ref_records = Store.open(urls["reference"], storage_options=options).outcome_records()
        if problem is None and not records.equals(ref_records):
            problem = (
                f"the head's {records.num_rows} outcome records differ from the reference's "
                f"{ref_records.num_rows}"
            )
        _show_evidence(dirs, ckpt_step, crash, cfg, console)
        _show_store(urls["run"], os.path.join(out, "growth.png"), console, server)
        _show_pass_rates(records, cfg, console)
        _run_cli(["stats", urls["run"], "--top", "3"], console, server)
        s3_note = None
        if server is not None:
            # The server dies with the demo: keep byte-for-byte local copies that stay valid.
            s3_note = {"urls": dict(urls), "endpoint": server.endpoint,
                       "note": "the demo's loopback S3 server stopped when the demo ended; "
                               "urls are local copies of these stores"}  # fmt: skip
            urls = {name: _copy_local(url, os.path.join(out, "s3-copy", name), options)
                    for name, url in urls.items()}  # fmt: skip
    summary = {
        "ok": problem is None,
        "problem": problem,
        "crash_after_step": crash,
        "checkpoint_step": ckpt_step,
        "rolled_back_steps": lost,
        "urls": urls,
        "s3": s3_note,
        "head_version": head.version,
        "head_rows": head.num_rows,
        "outcome_records": records.num_rows,
        "pass_rates": [
            {"steps": [first, last], "pass_rate": rate}
            for first, last, rate in pass_rates(records, cfg)
        ],
        "config": asdict(cfg),
    }
    _write_atomic(os.path.join(out, "summary.json"), json.dumps(summary, indent=2))
    if problem is not None:
        console.print(f"resume exact: MISMATCH {problem}", markup=False)
        return False
    console.print(
        f"resume exact: OK (steps {ckpt_step + 1}..{cfg.steps - 1} after the crash, their scores, "
        f"and the head, {head.num_rows} rows and {records.num_rows} outcome records at version "
        f"{head.version}, equal the uninterrupted run)",
        markup=False,
    )
    console.print(
        "\nSee it in a browser (growth, rows, each task's ancestors by _dynstate_source, "
        "pass rates per step):\n"
        f"  dynstate serve {urls['run']}",
        markup=False,
    )
    return True


def _s3_server() -> Any:
    from loopback_s3 import loopback_s3  # tools/loopback_s3.py, next to this file

    return loopback_s3(S3_BUCKET, set_env=False)


def _storage_options(server: Any) -> dict[str, Any] | None:
    """Explicit options for the loopback server: nothing in this process's environment
    changes (a user's own AWS settings stay as they were)."""
    if server is None:
        return None
    env = server.env()
    return {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": server.endpoint,
            "client_kwargs": {"region_name": env["AWS_DEFAULT_REGION"]}}  # fmt: skip


def _child_env(server: Any) -> dict[str, str]:
    """A child's environment: the parent's, pointed at the loopback server for --s3."""
    return {**os.environ, **(server.env() if server is not None else {})}


def _copy_local(url: str, dest: str, options: dict[str, Any] | None) -> str:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.get(root.rstrip("/") + "/", dest, recursive=True)
    return dest


def _ids(rows: list[dict[str, Any]], most: int = 4) -> str:
    ids = [row["id"] for row in rows]
    return " ".join(ids[:most]) + (f" +{len(ids) - most}" if len(ids) > most else "")


def _show_evidence(dirs: list[str], ckpt_step: int, crash: int, cfg: DemoConfig, console) -> None:
    """Both runs' batches for the steps after the checkpoint, side by side: the steps the
    crashed run had done (and lost) and the first ones after them."""
    reference = {s["step"]: s["rows"] for s in read_stream(os.path.join(dirs[0], "stream.jsonl"))}
    resumed = {s["step"]: s["rows"]
               for s in read_stream(os.path.join(dirs[1], "stream-resumed.jsonl"))}  # fmt: skip
    last = min(cfg.steps - 1, crash + 3)
    console.print(
        f"\nbatches after the checkpoint (step {ckpt_step}): the uninterrupted reference run "
        "and the run resumed after the SIGKILL",
        markup=False,
    )
    console.print(f"{'step':>4}  {'reference run':<38}  {'resumed run':<38}  same", markup=False)
    for step in range(ckpt_step + 1, last + 1):
        ours, theirs = resumed.get(step, []), reference.get(step, [])
        note = "yes" if ours == theirs else "NO"
        console.print(f"{step:>4}  {_ids(theirs):<38}  {_ids(ours):<38}  {note}", markup=False)
    if last < cfg.steps - 1:
        same = all(resumed.get(s) == reference.get(s) for s in range(ckpt_step + 1, cfg.steps))
        console.print(
            f"  ... steps {last + 1}-{cfg.steps - 1}: "
            + ("all batches equal" if same else "batches DIFFER"),
            markup=False,
        )


def _crash_and_resume(
    urls: dict[str, str], out: str, cfg: DemoConfig, crash: int, console: Any, server: Any
) -> tuple[int, list[int]]:
    """Run the reference and the training run side by side, SIGKILL the training run after
    step ``crash``, resume it; returns the checkpoint step and the rounds rolled back."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    ref_dir, run_dir = os.path.join(out, "reference"), os.path.join(out, "run")
    children: list[_Child] = []
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn())
    try:
        with Progress(*columns, console=console, disable=not console.is_terminal) as bars:

            def follow(child: _Child, bar: Any, offset: int = 0) -> int:
                done = child.steps()
                bars.update(bar, completed=offset + done)
                return done

            ref = _Child(urls["reference"], ref_dir, cfg, server)
            run = _Child(urls["run"], run_dir, cfg, server)
            children += [ref, run]
            ref_bar = bars.add_task("reference run (uninterrupted)", total=cfg.steps)
            run_bar = bars.add_task("training run (will crash)", total=cfg.steps)
            while run.proc.poll() is None:
                follow(ref, ref_bar)
                if follow(run, run_bar) > crash:
                    run.kill()
                time.sleep(0.02)
            if run.proc.returncode != -signal.SIGKILL:
                early = " (it finished before the kill: use a larger --step-time)"
                raise RuntimeError(
                    run.failure("the training run" + early * (not run.proc.returncode))
                )
            found = _latest_checkpoint(os.path.join(run_dir, "ckpt"))
            if found is None:  # cannot happen: the crash step lies after the first checkpoint
                raise RuntimeError(run.failure("the training run (no checkpoint)"))
            ckpt_step = found[0]
            versions = Store.open(urls["run"], storage_options=_storage_options(server)).versions()
            lost = [c.meta["step"] for c in versions if c.meta.get("step", -1) > ckpt_step]
            bars.update(run_bar, description=f"training run (killed after {run.steps()})")
            console.print(
                f"SIGKILLed the training process after step {crash}; its last checkpoint is "
                f"step {ckpt_step},\n  and it had committed rounds of steps {lost} after it "
                "(the resume rolls them back)"
            )
            resumed = _Child(urls["run"], run_dir, cfg, server, resume=True)
            children.append(resumed)
            res_bar = bars.add_task(f"resumed from step {ckpt_step}", total=cfg.steps)
            while resumed.proc.poll() is None or ref.proc.poll() is None:
                follow(ref, ref_bar)
                follow(resumed, res_bar, ckpt_step + 1)
                time.sleep(0.02)
            follow(ref, ref_bar)
            follow(resumed, res_bar, ckpt_step + 1)
    finally:
        # The children run in their own sessions: Ctrl-C or an error here must not orphan them.
        for child in children:
            if child.proc.poll() is None:
                child.kill()
    for child, what in ((ref, "the reference run"), (resumed, "the resumed run")):
        if child.proc.returncode != 0:
            raise RuntimeError(child.failure(what))
    return ckpt_step, lost


def _show_store(url: str, png: str, console: Any, server: Any) -> None:
    """``dynstate ls --all`` and ``dynstate plot``, run as a user would run them; the
    listing shortened to the versions around the rollback."""
    _run_cli(["ls", url, "--all", "--limit", "0"], console, server, shorten=shorten_listing)
    _run_cli(["plot", url, png], console, server)


def _run_cli(
    args: list[str], console: Any, server: Any, shorten: Any = None
) -> subprocess.CompletedProcess[str]:
    """One ``dynstate`` command, run as a user would run it, echoed with its output."""
    exe = os.path.join(os.path.dirname(sys.executable), "dynstate")
    command = [exe] if os.path.exists(exe) else [sys.executable, "-m", "dynstate.cli"]
    env = {**_child_env(server), "COLUMNS": os.environ.get("COLUMNS", "100")}
    console.print(f"\n$ dynstate {' '.join(args)}", markup=False)
    sys.stdout.flush()
    proc = subprocess.run([*command, *args], env=env, capture_output=True, text=True)
    text = proc.stdout if shorten is None or proc.returncode else shorten(proc.stdout)
    console.print((text + proc.stderr).rstrip("\n"), markup=False)
    return proc


def shorten_listing(text: str, keep: int = 3) -> str:
    """``dynstate ls``'s table with only what the demo is about: the newest ``keep`` versions,
    the reset and the versions it abandoned (with one on each side), and the first two (the
    store's creation and the initial import). Each run of left-out rows becomes one line
    saying how many, so nothing looks listed that is not."""
    lines = text.splitlines()
    rows = [i for i, line in enumerate(lines) if line[:7].strip().isdigit()]
    if len(rows) <= 2 * keep + 4:
        return text
    wanted = set(rows[:keep]) | set(rows[-2:])
    for k, i in enumerate(rows):
        if "abandoned" in lines[i] or lines[i][7:].lstrip().startswith("reset"):
            wanted.update(rows[max(0, k - 1) : k + 2])
    out: list[str] = []
    left_out = 0
    for i, line in enumerate(lines):
        if i in rows and i not in wanted:
            left_out += 1
            continue
        if left_out:
            out.append(
                f"{'...':>7}  ({left_out} versions left out here; run the command to see all)"
            )
            left_out = 0
        out.append(line)
    return "\n".join(out) + "\n"


def pass_rates(records: pa.Table, cfg: DemoConfig) -> list[tuple[int, int, float]]:
    """The pass rate (the share of samples scored above 0.5, dynstate's success) of each
    group of steps, from the head's outcome records: ``(first step, last step, rate)``, at
    most 12 groups."""
    steps, scores = records.column("step").to_pylist(), records.column("score").to_pylist()
    width = -(-cfg.steps // 12)
    groups: dict[int, list[float]] = {}
    for step, value in zip(steps, scores, strict=True):
        groups.setdefault(step // width, []).append(value)
    return [
        (g * width, min(cfg.steps, (g + 1) * width) - 1, sum(v > 0.5 for v in vs) / len(vs))
        for g, vs in sorted(groups.items())
    ]


def _show_pass_rates(records: pa.Table, cfg: DemoConfig, console: Any) -> None:
    console.print(
        "\npass rate per step (the outcomes recorded with the rounds, store.outcome_records()):",
        markup=False,
    )
    for first, last, rate in pass_rates(records, cfg):
        bar = "#" * round(40 * rate)
        console.print(f"  steps {first:>3}-{last:<3} {bar:<40} {rate:>4.0%}", markup=False)


def _train_main(arg: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = json.loads(arg)
    train(args["url"], args["workdir"], DemoConfig(**args["cfg"]), resume=args["resume"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/demo.py",
        description="A curriculum run with dynamic data generation (scores recorded as "
        "outcomes, rows drawn by Learnability), SIGKILLed mid-run, resumed from its last "
        "checkpoint and compared with an uninterrupted run; then `dynstate ls`, a growth plot, "
        "the pass rate per step and `dynstate stats`.",
    )
    parser.add_argument("--dir", default="demo-out", help="output directory (default demo-out)")
    parser.add_argument("--s3", action="store_true", help="stores on a loopback S3 server (moto)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mode", choices=["epoch", "mix"], default="epoch")
    parser.add_argument("--step-time", type=float, default=0.4, help="simulated seconds per step")
    args = parser.parse_args(argv)
    cfg = DemoConfig(steps=args.steps, seed=args.seed, workers=args.workers, mode=args.mode,
                     step_time=args.step_time)  # fmt: skip
    try:
        ok = run_demo(args.dir, s3=args.s3, cfg=cfg)
    except (DynstateError, RuntimeError) as exc:  # a training process failed: its log tail
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["_train"]:
        _train_main(sys.argv[2])
    else:
        sys.exit(main())
