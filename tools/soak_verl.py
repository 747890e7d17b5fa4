"""Soak the verl integration: many SIGKILL chains on verl's real RayPPOTrainer.fit().

    python tools/soak_verl.py --trials 30 --seed 1 [--s3]

Each trial runs tests/verl_cpu.py's driver (verl's legacy trainer with dynstate's mixin, CPU
stand-ins for the GPU workers) and SIGKILLs it at 1-3 random instants — in rollout, right after
a checkpoint, in validation, right after a round commit — resuming each time in a fresh
process, in epoch or mix mode with 0 or 2 loader workers, on a local store (or loopback S3 with
``--s3``). Every batch any process trained on and the final store must equal the uninterrupted
reference run's (tests/test_verl.py::kill_chain). Exits 1 on the first difference, printing the
trial to replay.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from test_verl import MIX, SAVE_FREQ, STEPS, TEST_FREQ, Zygote, kill_chain, run_reference  # noqa: E402

SAVES = sorted({*range(SAVE_FREQ, STEPS + 1, SAVE_FREQ), STEPS})
VALIDATIONS = sorted({*range(TEST_FREQ, STEPS + 1, TEST_FREQ), STEPS})


def random_kills(rng: random.Random) -> list[tuple[int, str]]:
    """1-3 kill points at strictly increasing steps, each one a point the run reaches."""
    kills: list[tuple[int, str]] = []
    step = 0
    for _ in range(rng.randint(1, 3)):
        options = [
            (s, i)
            for s in range(step + 1, STEPS + 1)
            for i in ("rollout", "committed", "saved", "validation")
            if (i != "saved" or s in SAVES)
            and (i != "validation" or s in VALIDATIONS)
            # After the final checkpoint verl, resumed, trains one step more than the
            # reference (its own resume arithmetic, docs/verl.md): nothing to compare.
            and not (s == STEPS and i in ("saved", "validation"))
        ]
        if not options:
            break
        step, instant = rng.choice(options)
        kills.append((step, instant))
    return kills


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3", action="store_true", help="stores on a loopback S3 server")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with contextlib.ExitStack() as stack:
        if args.s3:
            from conftest import S3_BUCKET
            from loopback_s3 import loopback_s3  # tools/loopback_s3.py

            stack.enter_context(loopback_s3(S3_BUCKET))
        from conftest import s3_url

        root = pathlib.Path(tempfile.mkdtemp(prefix="soak-verl-"))
        zygote = Zygote(str(root))
        stack.callback(zygote.close)
        (root / "data").mkdir()
        files = {
            "train": str(root / "data" / "train.parquet"),
            "val": str(root / "data" / "val.parquet"),
            "model": str(root / "model"),
        }
        spec = {"cmd": "data", "folder": str(root / "data"), "model": files["model"]}
        assert zygote.call({**spec, "output": str(root / "d.out")}) == 0
        world = (zygote, root, files)
        references = {}
        for trial in range(args.trials):
            mode, workers = rng.choice(("epoch", "mix")), rng.choice((0, 2))
            extra = {"num_workers": workers, "dynstate": MIX if mode == "mix" else {}}
            if (mode, workers) not in references:
                store = {"store": s3_url()} if args.s3 else {}
                references[mode, workers] = run_reference(
                    world, f"ref-{mode}-{workers}", **extra, **store
                )
            kills = random_kills(rng)
            store = {"store": s3_url()} if args.s3 else {}
            try:
                kill_chain(world, f"t{trial}", kills, references[mode, workers], **extra, **store)
                verdict = "ok"
            except Exception as exc:
                verdict = f"FAIL: {str(exc)[:2000]}"
            print(f"trial {trial}: {mode}, {workers} workers, kills {kills}: {verdict}")
            if verdict != "ok":
                print(f"  replay: {root / f't{trial}'}")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
