"""The differential read test (``tests/test_read_oracle.py``: every read path of
``VersionedDataset`` against the version's shards read whole with pyarrow, then ``take``) with
many more hypothesis examples than the suite runs.

    python tools/oracle_long.py                     # 1,000 examples per read test and state
    python tools/oracle_long.py --long              # 10,000 (hours on two cores)
    python tools/oracle_long.py --examples 5000 -k memory   # pytest's own options follow

The suite runs 40 (``DYNSTATE_ORACLE_EXAMPLES``); the loader and epoch tests take a share
of the count. A failure prints hypothesis's smallest example and is kept in
``.hypothesis/``, so a plain ``python -m pytest tests/test_read_oracle.py`` replays it.
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="per read test and state")
    parser.add_argument("--long", action="store_true", help="10,000 examples")
    args, pytest_args = parser.parse_known_args(argv)
    examples = 10_000 if args.long else args.examples
    if examples < 1:
        parser.error("--examples must be at least 1")
    env = {**os.environ, "DYNSTATE_ORACLE_EXAMPLES": str(examples)}
    command = [sys.executable, "-m", "pytest", "-q", "tests/test_read_oracle.py", *pytest_args]
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
