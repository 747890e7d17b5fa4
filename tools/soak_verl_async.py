"""Kill soak for verl's async trainers with dynstate (issue 42.4): verl's real ``fit()`` in
``colocate_async`` or ``separate_async`` mode on the CPU stand-ins of ``tests/verl_v1_standins.py``
(stale drops every step, DAPO filtering, a rollout session that fails for some prompts), run as
a driver process that is SIGKILLed at random instants — sometimes paused with SIGSTOP first —
together with its Ray cluster, and started again until it has trained every step.

Unlike the suite's kill chains, which kill at named instants (in rollout, in validation, right
after a commit or a checkpoint), a kill here lands wherever the clock says: in Ray's start-up,
inside a round's commit, between verl's ``data.pt`` and its ``transfer_queue/`` checkpoint,
inside the resume's rollback. Each trial ends with the audit of the suite
(``verl_v1_standins.audit_exactly_once``): one format-2 consumption record per step on the
head's lineage, each step's ``carried_in`` the step before's ``in_flight``, every row drawn
trained, filtered, dropped or still in flight exactly once over the run, each epoch's draws a
permutation of its pinned version's rows, every trained prompt its row's (the shards read whole
with pyarrow). Exit status 1 on any violation or a driver that fails on its own, else 0.

    python tools/soak_verl_async.py --trials 3 --mode colocate
    python tools/soak_verl_async.py --trials 3 --mode separate --kills 4

A fifth of the kills land anywhere in a driver's start-up (2 to 40 s in), the rest 0 to 8 s
after the driver logs its first to fourth trained step, wherever that finds it; ``killed_at``
says how far each killed driver had come. A driver that ends before its kill is simply done.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

import verl_v1_standins as standins  # noqa: E402

STEPS = 6


def _spec(folder: str, mode: str, workers: int) -> dict:
    model = standins.make_model_dir(os.path.join(folder, "model"))
    train, val = standins.write_data(folder, n_train=30, n_val=4)
    return {
        "model": model,
        "train": train,
        "val": val,
        "store": os.path.join(folder, "store"),
        "ckpt": os.path.join(folder, "ckpt"),
        "log": os.path.join(folder, "log.jsonl"),
        "pids": os.path.join(folder, "pids.json"),
        "async": mode,
        "trainer_mode": standins.STANDIN_MODE,
        "steps": STEPS,
        "save_freq": 2,
        "test_freq": 3,
        "num_workers": workers,
        "policy": "dapo_fail",
        "overrides": [
            "trainer.v1.sampler.max_off_policy_threshold=1",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
        ],
    }


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _run(spec: dict, kill: tuple[int, float] | None, pause: bool, out: str) -> int | None:
    """One driver; SIGKILLed (with its Ray cluster) where ``kill`` says — ``(0, s)``: ``s``
    seconds after it starts; ``(k, s)``: ``s`` seconds after it logs its ``k``-th trained
    step — first paused with SIGSTOP for a while if ``pause``. Its exit status, or
    None when it was killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    with open(out, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, standins.__file__, json.dumps({**spec, "kill": None})],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if kill is None:
                return proc.wait(timeout=900)
            steps, seconds = kill
            if steps:  # wait for this driver's steps-th trained step
                logged, deadline = _lines(spec["log"]), time.monotonic() + 900
                while proc.poll() is None and _lines(spec["log"]) < logged + steps:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"a driver trained no step in 900 s; see {out}")
                    time.sleep(0.2)
            try:
                return proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass
            if pause:
                os.killpg(proc.pid, signal.SIGSTOP)
                time.sleep(random.uniform(0.5, 3.0))
            standins.end_leftovers(proc, spec["pids"])
            proc.wait()
            return None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            standins.end_leftovers(proc, spec["pids"])


def trial(folder: str, mode: str, kills: int, rng: random.Random) -> dict:
    spec = _spec(folder, mode, 0)
    out = os.path.join(folder, "drivers.txt")
    killed = 0
    where: list[str] = []  # how far each killed driver had come
    for _ in range(kills):
        spec["num_workers"] = rng.choice([0, 2])  # a resume may change the worker count
        # a fifth of the kills anywhere in start-up (imports, Ray, the resume's checks and
        # rollback), the rest a few seconds after the driver's 1st to 4th trained step: in
        # rollout, a commit, verl's checkpoint, validation or the next step
        if rng.random() < 0.2:
            kill = (0, rng.uniform(2.0, 40.0))
        else:
            kill = (rng.randint(1, 4), rng.uniform(0.0, 8.0))
        code = _run(spec, kill, rng.random() < 0.3, out)
        if code is None:
            killed += 1
            where.append(_progress(spec))
        elif code != 0:
            raise AssertionError(f"a driver failed on its own (exit {code}); see {out}")
        else:
            break  # done before its kill
    code = _run(spec, None, False, out)
    if code != 0:
        raise AssertionError(f"the last driver failed (exit {code}); see {out}")
    records = standins.audit_exactly_once(spec["store"], standins.read_log(spec["log"]), STEPS)
    reasons = sorted({reason for r in records for _, reason in r["dropped"]})
    return {
        "killed": killed,
        "killed_at": where,
        "drop_reasons": reasons,
        "in_flight_end": len(records[-1]["in_flight"]),
    }


def _progress(spec: dict) -> str:
    """Where a killed driver was: the last step logged (by it, or before it) and the newest
    checkpoint."""
    logged = 0
    if os.path.exists(spec["log"]):
        with open(spec["log"]) as f:
            lines = [line for line in f if line.strip()]
        logged = json.loads(lines[-1])["step"] if lines else 0
    tracker = os.path.join(spec["ckpt"], "latest_checkpointed_iteration.txt")
    saved = "none"
    if os.path.exists(tracker):
        with open(tracker) as f:
            saved = f.read().strip()
    return f"last step logged {logged}, checkpoint {saved}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["colocate", "separate"], default="colocate")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3, help="random kills per trial (at most)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where trials keep their files")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    base = args.dir or tempfile.mkdtemp(prefix="soak-verl-async-")
    failures = 0
    for n in range(args.trials):
        folder = os.path.join(base, f"trial-{n}")
        os.makedirs(folder, exist_ok=True)
        try:
            result = trial(folder, args.mode, args.kills, rng)
            print(json.dumps({"trial": n, "mode": args.mode, "ok": True, **result}), flush=True)
        except AssertionError as exc:
            failures += 1
            print(
                json.dumps({"trial": n, "mode": args.mode, "ok": False, "error": str(exc)[:2000]})
            )
    print(json.dumps({"trials": args.trials, "failures": failures, "dir": base}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
