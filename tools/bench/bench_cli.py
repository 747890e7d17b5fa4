"""Start-up and listing speed of the `dynstate` command (issue 14): `dynstate --help` and
`dynstate ls URL --limit 20` on stores of 100 and 10,000 versions, on local disk and on S3
(the loopback moto server of tools/loopback_s3.py), each run as a fresh process exactly as a
user runs it. Reported: median wall time per command, the 10,000/100 ratio (the cost of `ls
--limit 20` should not grow with the history) and, on S3, the requests one `ls` sends.
Targets: `--help` well under 1 s (moonshot 0.3 s), `ls --limit 20` of a 10,000-version S3
store under 1 s. Never part of the tests.

    python tools/bench/bench_cli.py                  # stores built once under --dir
    python tools/bench/bench_cli.py --repeats 9 --sizes 100,10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/, for loopback_s3

BUCKET = "bench-cli"


def build(path: Path, versions: int) -> Path:
    """A local store of ``versions`` versions (one small round each, with a step and a
    generator, like a training run's), built once and reused from ``path``."""
    from dynstate import Store

    done = path / ".complete"
    if done.exists():
        return path
    started = time.perf_counter()
    store = Store.open(str(path), create=True)
    for step in range(store.refresh(), versions - 1):
        store.append([{"step": step, "prompt": f"task {step}"}],
                     meta={"step": step, "generator": "bench"})  # fmt: skip
    done.write_text(str(versions))
    print(f"  built {path} ({versions:,} versions) in {time.perf_counter() - started:.0f} s")
    return path


def dynstate_command() -> list[str]:
    exe = Path(sys.executable).with_name("dynstate")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dynstate.cli"]


def timed(args: list[str], repeats: int, env: dict[str, str]) -> float:
    """Median wall time of a fresh process running ``dynstate ARGS``."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([*dynstate_command(), *args], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".bench-out/cli", help="where stores are built once")
    parser.add_argument("--sizes", default="100,10000", help="versions per store")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--show-requests", action="store_true",
                        help="print the requests of one S3 `ls` (method, path, query)")  # fmt: skip
    args = parser.parse_args()
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    stores = {n: build(root / f"store-{n}", n) for n in sizes}
    env = {**os.environ, "COLUMNS": "100"}

    print(f"\npython {sys.version.split()[0]}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats} fresh processes")  # fmt: skip
    print(f"  dynstate --help                      {timed(['--help'], args.repeats, env):6.3f} s")
    local = {
        n: timed(["ls", str(p), "--limit", "20"], args.repeats, env) for n, p in stores.items()
    }
    for n in sizes:
        print(f"  ls --limit 20, local, {n:>6,} versions  {local[n]:6.3f} s")
    ratio = local[sizes[-1]] / local[sizes[0]]
    print(f"  ratio {sizes[-1]:,}/{sizes[0]:,} versions, local: {ratio:.2f}")
    if args.no_s3:
        return

    import fsspec
    from loopback_s3 import loopback_s3

    with loopback_s3(BUCKET) as server:
        fs = fsspec.filesystem("s3")
        remote: dict[int, float] = {}
        requests: dict[int, int] = {}
        for n, path in stores.items():
            url = f"s3://{BUCKET}/store-{n}"
            started = time.perf_counter()
            fs.put(str(path) + "/", f"{BUCKET}/store-{n}/", recursive=True)
            print(f"  uploaded {n:,} versions to the loopback S3 server in "
                  f"{time.perf_counter() - started:.0f} s")  # fmt: skip
            mark = server.count()
            remote[n] = timed(["ls", url, "--limit", "20"], args.repeats, {**env, **server.env()})
            requests[n] = (server.count() - mark) // args.repeats
            if args.show_requests:
                mark = server.count()
                timed(["ls", url, "--limit", "20"], 1, {**env, **server.env()})
                for method, where, query in server.since(mark):
                    print(f"    {method:4} {where}{'?' + query if query else ''}")
        for n in sizes:
            print(f"  ls --limit 20, S3,    {n:>6,} versions  {remote[n]:6.3f} s  "
                  f"({requests[n]} requests)")  # fmt: skip
        print(f"  ratio {sizes[-1]:,}/{sizes[0]:,} versions, S3: "
              f"{remote[sizes[-1]] / remote[sizes[0]]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
