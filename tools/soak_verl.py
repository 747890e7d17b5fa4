"""Soak the verl integration: many SIGKILL trials at random steps and phases.

    python tools/soak_verl.py --trials 100 --seed 1

Each trial runs tests/verl_harness.py's replay of RayPPOTrainer.fit until it SIGKILLs itself,
resumes it in a fresh process, and checks the batches and the final store against an
uninterrupted reference run (the lost-round window is checked as docs/verl.md describes).
Exits 1 on the first difference, printing the trial to replay.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from test_verl import STEPS, Zygote, batches, content, events, rounds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="soak-verl-")
    zygote = Zygote(root)
    data = os.path.join(root, "data")
    os.makedirs(data)
    assert zygote.call({"cmd": "data", "folder": data, "output": os.path.join(root, "d.out")}) == 0
    files = {"train": f"{data}/train.parquet", "val": f"{data}/val.parquet"}

    def spec(name: str, **extra) -> dict:
        d = os.path.join(root, name)
        os.makedirs(d)
        return {"cmd": "run", **files, "store": f"{d}/store", "ckpt": f"{d}/ckpt",
                "log": f"{d}/log.jsonl", "output": f"{d}/out.txt", **extra}  # fmt: skip

    ref = spec("reference")
    assert zygote.call(ref) == 0
    ref_batches, ref_final = batches(events(ref)[0]), content(ref["store"])
    failures = 0
    for trial in range(args.trials):
        step, workers = rng.randint(1, STEPS), rng.choice((0, 2))
        phase = rng.choice(("fetched", "saved", "committed") if step < STEPS else ("fetched",))
        s = spec(f"t{trial}", num_workers=workers)
        ok = zygote.call({**s, "kill": [step, phase]}) == -9 and zygote.call(s) == 0
        if ok:
            runs = events(s)
            resumed = runs[-1][0]["resumed_from"]
            got = rounds(s["store"])
            ok = sorted(got) == list(range(1, STEPS))
            lost = got.get(resumed, {}).get("lost", False)
            for b in (b for r in runs for b in batches(r).values()):
                if lost and b["step"] > resumed and b["new_pass"]:
                    break
                ok = ok and b["rows"] == ref_batches[b["step"]]["rows"]
            ok = ok and (lost or content(s["store"]) == ref_final)
        verdict = "ok" if ok else "FAIL"
        print(f"trial {trial}: kill at step {step} {phase}, {workers} workers: {verdict}")
        if not ok:
            failures += 1
            print(f"  replay: {s}")
            break
    zygote.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
