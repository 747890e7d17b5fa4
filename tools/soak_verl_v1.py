"""Soak dynstate on verl's V1 trainer: many SIGKILL chains on verl's real sync ``fit()``.

    python tools/soak_verl_v1.py --trials 10 --seed 1 [--s3]

Each trial picks epoch or mix mode and 0 or 2 loader workers, runs the uninterrupted reference
driver of tests/verl_v1_standins.py (verl's ``TaskRunnerV1`` with the dynstate trainer, CPU
stand-ins for GPU workers and the LLM server, a local Ray cluster per driver), then a chain of
1-3 drivers SIGKILLed at random instants — in rollout, right after a checkpoint, in
validation, right after a round commit — each resuming the previous one, and a last driver
that finishes. Every step's batch and the final store must equal the reference's. Exits 1 on
the first difference, printing the trial to replay. A driver takes about a minute on a loaded
2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import verl_v1_standins as standins  # noqa: E402

STEPS, SAVE_FREQ, TEST_FREQ = 8, 2, 3  # 26 rows, 4 a step: epoch 2 from step 7
SAVES = sorted({*range(SAVE_FREQ, STEPS + 1, SAVE_FREQ), STEPS})
VALIDATIONS = sorted({*range(TEST_FREQ, STEPS + 1, TEST_FREQ), STEPS})


def random_kills(rng: random.Random) -> list[tuple[int, str]]:
    """1-3 kill points at increasing steps, each one an instant the run reaches."""
    kills: list[tuple[int, str]] = []
    step = 0
    for _ in range(rng.randint(1, 3)):
        options = [
            (s, i)
            for s in range(step + 1, STEPS + 1)
            for i in standins.INSTANTS
            if (i != "saved" or s in SAVES) and (i != "validation" or s in VALIDATIONS)
        ]
        if not options:
            break
        step, instant = rng.choice(options)
        kills.append((step, instant))
    return kills


def trial(folder: str, files: dict, store_url, rng: random.Random) -> dict:
    mode = rng.choice(["epoch", "mix"])
    workers = rng.choice([0, 2])
    # mix mode's sampler waits for the round of step t - lag before it hands out step t; the
    # loader asks workers * prefetch_factor (torch's default 2) batches ahead
    lag = 1 if workers == 0 else workers * 2 + 1
    common = {
        **files,
        "steps": STEPS,
        "save_freq": SAVE_FREQ,
        "test_freq": TEST_FREQ,
        "num_workers": workers,
        "dynstate": {"mode": mode, "fresh_share": 0.5, "lag": lag},
    }
    kills = random_kills(rng)
    desc = {"mode": mode, "num_workers": workers, "lag": lag, "kills": kills}

    def spec(name: str) -> dict:
        return {
            **common,
            "store": store_url(name),
            "ckpt": os.path.join(folder, f"{name}-ckpt"),
            "log": os.path.join(folder, f"{name}.jsonl"),
            "pids": os.path.join(folder, f"{name}-pids.json"),
        }

    ref, run = spec("ref"), spec("run")
    standins.run_driver(ref)
    for kill in kills:
        standins.run_driver(run, tuple(kill))
    standins.run_driver(run)
    want, got = standins.read_log(ref["log"]), standins.read_log(run["log"])
    if want != got:
        bad = [s for s in sorted(set(want) | set(got)) if want.get(s) != got.get(s)]
        raise AssertionError(f"{desc}: steps {bad} trained other batches")
    if standins.store_summary(ref["store"]) != standins.store_summary(run["store"]):
        raise AssertionError(f"{desc}: the final stores differ")
    return desc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3", action="store_true", help="stores on a loopback S3 server")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with contextlib.ExitStack() as stack:
        if args.s3:
            sys.path.insert(0, HERE)
            from loopback_s3 import loopback_s3

            stack.enter_context(loopback_s3("dynstate-soak"))

        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-verl-v1-"))
        files = {"model": standins.make_model_dir(os.path.join(root, "model"))}
        files["train"], files["val"] = standins.write_data(root, n_train=30, n_val=4)
        for n in range(args.trials):
            folder = os.path.join(root, f"trial-{n}")
            os.makedirs(folder)
            prefix = uuid.uuid4().hex[:8]

            def store_url(name: str, folder: str = folder, prefix: str = prefix) -> str:
                if args.s3:
                    return f"s3://dynstate-soak/{prefix}-{name}"
                return os.path.join(folder, f"{name}-store")

            try:
                desc = trial(folder, files, store_url, rng)
            except AssertionError as exc:
                print(f"trial {n} (seed {args.seed}) FAILED: {exc}", flush=True)
                return 1
            print(f"trial {n}: same batches and store — {json.dumps(desc)}", flush=True)
    print(f"{args.trials} trials, no difference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
