"""Write arithmetic tasks in verl's parquet layout: ``python examples/verl/make_data.py data/arith``
(from the repository root: ``arith.yaml`` reads ``data/arith/train.parquet`` and ``test.parquet``
relative to where the run starts)."""

from __future__ import annotations

import argparse
import os
import random
import sys

import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arith_generator import make_task


def main(folder: str, n_train: int = 2000, n_val: int = 200) -> None:
    rng = random.Random(0)
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_val)):
        rows = [make_task(rng.randint(1, 999), rng.randint(1, 999), i, split) for i in range(n)]
        pd.DataFrame(rows).to_parquet(os.path.join(folder, f"{split}.parquet"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write arithmetic tasks in verl's parquet layout.")
    parser.add_argument(
        "folder", nargs="?", default="data/arith", help="where train.parquet and test.parquet go"
    )
    parser.add_argument("--train", type=int, default=2000, help="training tasks")
    parser.add_argument("--val", type=int, default=200, help="validation tasks")
    args = parser.parse_args()
    main(os.path.expanduser(args.folder), args.train, args.val)
