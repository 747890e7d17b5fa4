"""The S3 rows side by side on the clients dynstate can use (issue 41.4): obstore (the
default) and s3fs (``DYNSTATE_S3_CLIENT=s3fs``, the fallback for configurations obstore
cannot serve), and, with ``--baseline CHECKOUT``, another checkout of dynstate (for example
the commit before a change: ``git worktree add /tmp/before <commit>``), on the loopback moto
server of tools/loopback_s3.py. Each measurement runs in a fresh process, the variants
alternated round by round so that the machine's load falls on all alike:

- ``ls``: ``dynstate ls URL --limit 20`` on a store of ``--versions`` versions, wall time of
  the process, and the requests it sends;
- import: the sum of ``python -X importtime`` over every module ``dynstate ls`` imports (what
  a read-only command pays before its first request);
- first batch: open a ``VersionedDataset`` with a fresh cache and read one batch of 256
  random rows (timed inside the process; requests counted);
- commit: ``--commits`` appends of a 64-row round to one store (median per append, inside
  the process, after one warm-up append that builds the client and probes the exclusive
  create).

    python tools/bench/bench_s3_clients.py --versions 100 --repeats 7 [--baseline /tmp/before]

Never part of the tests; times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/, for loopback_s3

BUCKET = "bench-clients"

FIRST_BATCH = """
import json, sys, tempfile, time
import numpy as np
from dynstate import VersionedDataset
url = sys.argv[1]
t = time.perf_counter()
ds = VersionedDataset(url, cache_dir=tempfile.mkdtemp())
idx = np.random.default_rng(int(sys.argv[2])).choice(len(ds), 256, replace=False).tolist()
batch = ds.read_batch(idx, "columns")
print(json.dumps({"s": time.perf_counter() - t, "rows": len(batch["row"])}))
"""

COMMITS = """
import json, statistics, sys, time
from dynstate import Store
url, n = sys.argv[1], int(sys.argv[2])
store = Store.open(url, create=True)
store.append([{"row": r, "text": "x" * 64} for r in range(64)])  # warm-up: client, probe
times = []
for i in range(n):
    t = time.perf_counter()
    store.append([{"row": r, "text": "x" * 64} for r in range(64)])
    times.append(time.perf_counter() - t)
print(json.dumps({"median": statistics.median(times), "min": min(times)}))
"""


def _env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.pop("DYNSTATE_S3_CLIENT", None)
    env.update(extra)
    return env


def _run(command: list[str], env: dict[str, str]) -> tuple[float, str, str]:
    import time

    t = time.perf_counter()
    # Not from the checkout: `python -m`/`-c` put the working directory first on sys.path,
    # before PYTHONPATH, which would hide --baseline's dynstate behind this one.
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, check=False, cwd=tempfile.gettempdir()
    )
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{command} failed:\n{done.stderr[-3000:]}")
    return wall, done.stdout, done.stderr


def import_us(stderr: str) -> tuple[int, list[str]]:
    """Total self time of every import in a ``-X importtime`` report, and the top-level
    client packages among them."""
    total, clients = 0, set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|(\s*)(\S+)", line)
        if m:
            total += int(m.group(1))
            top = m.group(3).split(".")[0]
            if top in ("s3fs", "botocore", "aiobotocore", "aiohttp", "obstore", "fsspec"):
                clients.add(top)
    return total, sorted(clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--rows", type=int, default=50_000, help="rows of the first-batch store")
    parser.add_argument(
        "--baseline", metavar="CHECKOUT", help="another dynstate checkout, run as a third column"
    )
    args = parser.parse_args()
    clients: dict[str, dict[str, str]] = {}
    if args.baseline:  # first on sys.path: its dynstate, not the installed one
        clients["baseline"] = {"PYTHONPATH": str(Path(args.baseline).resolve())}
    clients["s3fs"] = {"DYNSTATE_S3_CLIENT": "s3fs"}
    clients["obstore"] = {}

    from loopback_s3 import loopback_s3

    from dynstate import Store

    cli = [sys.executable, "-m", "dynstate.cli"]
    with loopback_s3(BUCKET) as server:
        base = {**os.environ, **server.env()}
        os.environ.update(server.env())
        os.environ.pop("DYNSTATE_S3_CLIENT", None)
        listed = f"s3://{BUCKET}/versions-{args.versions}"
        store = Store.open(listed, create=True)
        for v in range(args.versions):
            store.append([{"row": v, "step": v}], meta={"step": v})
        rows = f"s3://{BUCKET}/rows"
        store = Store.open(rows, create=True)
        per = args.rows // 8
        for s in range(8):
            store.append([{"row": s * per + r, "text": "t" * 200} for r in range(per)])

        results: dict[str, dict[str, list[Any]]] = {c: {} for c in clients}
        for extra in clients.values():  # warm the page cache and the server for each
            _run([*cli, "ls", listed, "--limit", "20"], _env(base, extra))
        for rep in range(args.repeats):
            order = list(clients.items())
            if rep % 2:
                order.reverse()
            for name, extra in order:
                env = _env(base, extra)
                r = results[name]
                mark = server.count()
                wall, _, _ = _run([*cli, "ls", listed, "--limit", "20"], env)
                r.setdefault("ls_s", []).append(wall)
                r.setdefault("ls_requests", []).append(server.count() - mark)
                _, _, err = _run([sys.executable, "-X", "importtime", *cli[1:], "ls", listed,
                                  "--limit", "20"], env)  # fmt: skip
                us, packages = import_us(err)
                r.setdefault("import_ms", []).append(us / 1e3)
                r["clients_imported"] = packages
                mark = server.count()
                _, out, _ = _run([sys.executable, "-c", FIRST_BATCH, rows, str(rep)], env)
                r.setdefault("first_batch_s", []).append(json.loads(out)["s"])
                r.setdefault("first_batch_requests", []).append(server.count() - mark)
        for name, extra in clients.items():
            url = f"s3://{BUCKET}/commits-{name.replace('+', '-')}"
            _, out, _ = _run(
                [sys.executable, "-c", COMMITS, url, str(args.commits)], _env(base, extra)
            )
            results[name]["commit_s"] = [json.loads(out)["median"]]

    print(f"loopback S3, {args.repeats} alternated rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'':24}" + "".join(f"{n:>16}" for n in clients))
    keys = [
        ("ls_s", "ls --limit 20 (s)", 3),
        ("ls_requests", "ls requests", 0),
        ("import_ms", "ls imports (ms)", 0),
        ("first_batch_s", "first batch (s)", 3),
        ("first_batch_requests", "first batch requests", 0),
        ("commit_s", "commit median (s)", 4),
    ]
    for key, label, digits in keys:
        cells = [statistics.median(results[n][key]) for n in clients]
        print(f"{label:24}" + "".join(f"{c:>16.{digits}f}" for c in cells))
    for n in clients:
        print(f"{n}: client packages a read-only ls imports: {results[n]['clients_imported']}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
