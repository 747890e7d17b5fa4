"""Start-up and listing speed of the `dynstate` command (issue 14): `dynstate --help` and
`dynstate ls URL --limit 20` on stores of 100 and 10,000 versions, on local disk and on S3
(the loopback moto server of tools/loopback_s3.py), each run as a fresh process exactly as a
user runs it. Reported: median wall time per command, the 10,000/100 ratio (the cost of `ls
--limit 20` should not grow with the history) and, on S3, the requests one `ls` sends.
Targets: `--help` well under 1 s (moonshot 0.3 s), `ls --limit 20` of a 10,000-version S3
store under 1 s. Never part of the tests.

With ``--delta`` (issue 23.3) a Delta table of as many versions (one one-row append each, the
same step and generator in the commit's metadata), built with deltalake and uploaded to the
same loopback endpoint, is read by ``DeltaTable(uri, storage_options=...).history(20)`` in a
fresh ``python -c`` process, alternated with ``dynstate ls --limit 20``: per-round ratios and
their median, and the requests each sends. deltalake is a benchmark-only dependency
(``pip install 'dynstate[bench]'``).

    python tools/bench/bench_cli.py                  # stores built once under --dir
    python tools/bench/bench_cli.py --repeats 9 --sizes 100,10000
    python tools/bench/bench_cli.py --sizes 100 --repeats 11 --delta [--show-requests]
    python tools/bench/bench_cli.py --sizes 100 --no-local --header-ab 0.02
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def build_delta(path: Path, versions: int) -> Path:
    """A Delta table of ``versions`` versions, each a one-row append whose commit carries the
    step and generator (as dynstate's rounds do), built once and reused from ``path``."""
    import pyarrow as pa
    from deltalake import CommitProperties, write_deltalake

    done = path / ".complete"
    if done.exists():
        return path
    started = time.perf_counter()
    for step in range(versions):
        write_deltalake(str(path), pa.table({"step": [step], "prompt": [f"task {step}"]}),
                        mode="append",
                        commit_properties=CommitProperties(
                            custom_metadata={"step": str(step), "generator": "bench"}))  # fmt: skip
    done.write_text(str(versions))
    print(f"  built {path} ({versions:,} Delta versions) in {time.perf_counter() - started:.0f} s")
    return path


# A fresh process reading the newest 20 commits of a Delta table on S3, and printing them as
# `ls` prints its rows (so both pay for their output). Credentials and endpoint from the env.
DELTA_HISTORY = """
import os, sys
from deltalake import DeltaTable
options = {"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "AWS_ALLOW_HTTP": "true",
           "AWS_REGION": os.environ["AWS_DEFAULT_REGION"],
           "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
           "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"]}
for commit in DeltaTable(sys.argv[1], storage_options=options).history(20):
    print(commit.get("version"), commit.get("operation"), commit.get("timestamp"),
          commit.get("step"), commit.get("generator"))
"""


S3FS_ONE_GET = """
import sys, s3fs
s3fs.S3FileSystem().cat_file(sys.argv[1], max_concurrency=1)
"""


def delta_command() -> list[str]:
    return [sys.executable, "-c", DELTA_HISTORY]


def dynstate_command() -> list[str]:
    exe = Path(sys.executable).with_name("dynstate")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dynstate.cli"]


def once(command: list[str], env: dict[str, str]) -> float:
    """Wall time of one fresh process running ``command``."""
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def timed(args: list[str], repeats: int, env: dict[str, str]) -> float:
    """Median wall time of a fresh process running ``dynstate ARGS``."""
    return statistics.median(once([*dynstate_command(), *args], env) for _ in range(repeats))


def side_by_side(server: Any, url: str, delta_uri: str, repeats: int, env: dict[str, str],
                 show: bool) -> None:  # fmt: skip
    """``dynstate ls --limit 20`` and Delta's ``history(20)``, alternated in fresh processes
    with what stands below any s3fs command (the interpreter, ``import s3fs``, a client and
    one GET): medians, the median of the per-round dynstate/Delta ratios, and the requests of
    one run of each."""
    s3_env = {**env, **server.env()}
    key = url[len("s3://") :] + "/_dynstate/store.json"
    runs = {
        "dynstate": [*dynstate_command(), "ls", url, "--limit", "20"],
        "delta": [*delta_command(), delta_uri],
        # What any command on s3fs pays before its first record: the interpreter, the client
        # libraries' import, then the client's set-up and one GET.
        "python": [sys.executable, "-c", "pass"],
        "import s3fs": [sys.executable, "-c", "import s3fs"],
        "s3fs one GET": [sys.executable, "-c", S3FS_ONE_GET, key],
    }
    for command in runs.values():  # warm the page cache and moto, not timed
        once(command, s3_env)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for name in order:
            times[name].append(once(runs[name], s3_env))
    ratios = [d / t for d, t in zip(times["dynstate"], times["delta"], strict=True)]
    requests = {}
    for name, command in list(runs.items())[:2]:
        mark = server.count()
        once(command, s3_env)
        requests[name] = server.since(mark)
    print(f"  S3, dynstate ls --limit 20 vs Delta history(20), {repeats} alternated rounds, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    labels = {"dynstate": "dynstate ls --limit 20", "delta": "Delta history(20)"}
    for name, spread in times.items():
        sent = f"  {len(requests[name])} requests" if name in requests else ""
        print(f"    {labels.get(name, name):24} {statistics.median(spread):6.3f} s  "
              f"[{min(spread):.3f}-{max(spread):.3f}]{sent}")  # fmt: skip
    print(f"    ratio dynstate/Delta     {statistics.median(ratios):6.2f}  "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")  # fmt: skip
    if show:
        for name, seen in requests.items():
            print(f"    requests of one {name} run:")
            for method, where, query in seen:
                print(f"      {method:4} {where}{'?' + query if query else ''}")


def header_ab(server: Any, url: str, delay_s: float, rounds: int) -> None:
    """In one process: ``ls``'s summary and rows read one after the other (the order before
    issue 23.3's change) against the CLI's header-beside-rows, alternated on fresh handles,
    every request delayed ``delay_s`` by the fault proxy of tests/s3_faults.py (an S3 round
    trip longer than loopback's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from s3_faults import FaultProxy

    from dynstate.cli.commands_ls import _summary_and_rows
    from dynstate.cli.options import open_store
    from dynstate.history import summary, version_rows

    def in_series(store: Any) -> Any:
        info = summary(store, refresh=False)
        return info, version_rows(store, limit=20, refresh=False, tags=info["tags"])

    def beside(store: Any) -> Any:
        return _summary_and_rows(store, False, 20, False)

    with FaultProxy(server.endpoint, rate=1.0, kinds=("delay",), delay_s=delay_s) as proxy:
        options = {"endpoint_url": proxy.url}
        open_store(url, options)  # the client, once: both then reuse it
        times: dict[str, list[float]] = {"in series": [], "beside": []}
        runs = {"in series": in_series, "beside": beside}
        for round_ in range(rounds):
            for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
                store = open_store(url, options)
                started = time.perf_counter()
                runs[name](store)
                times[name].append(time.perf_counter() - started)
    print(f"  ls's summary + rows after opening, every request delayed {delay_s * 1000:.0f} ms, "
          f"{rounds} alternated rounds, load {os.getloadavg()[0]:.1f}:")  # fmt: skip
    for name, spread in times.items():
        print(f"    header {name:9} median {statistics.median(spread) * 1000:6.1f} ms, "
              f"min {min(spread) * 1000:6.1f} ms")  # fmt: skip


def local_runs(stores: dict[int, Path], repeats: int, env: dict[str, str]) -> None:
    print(f"  dynstate --help                      {timed(['--help'], repeats, env):6.3f} s")
    local = {n: timed(["ls", str(p), "--limit", "20"], repeats, env) for n, p in stores.items()}
    sizes = list(stores)
    for n in sizes:
        print(f"  ls --limit 20, local, {n:>6,} versions  {local[n]:6.3f} s")
    ratio = local[sizes[-1]] / local[sizes[0]]
    print(f"  ratio {sizes[-1]:,}/{sizes[0]:,} versions, local: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".bench-out/cli", help="where stores are built once")
    parser.add_argument("--sizes", default="100,10000", help="versions per store")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--no-local", action="store_true", help="skip --help and local ls")
    parser.add_argument("--delta", action="store_true",
                        help="on S3, also Delta's history(20) (needs deltalake)")  # fmt: skip
    parser.add_argument("--header-ab", type=float, metavar="DELAY_S", default=None,
                        help="on S3, also time ls's header beside its rows against in series, "
                        "each request delayed DELAY_S")  # fmt: skip
    parser.add_argument("--show-requests", action="store_true",
                        help="print the requests of one S3 `ls` (method, path, query)")  # fmt: skip
    args = parser.parse_args()
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    stores = {n: build(root / f"store-{n}", n) for n in sizes}
    env = {**os.environ, "COLUMNS": "100"}
    # An installed package has its bytecode (pip compiles it at install time); an editable
    # checkout gets it on its first import, unless PYTHONDONTWRITEBYTECODE is set (this
    # machine sets it), and then every fresh process compiles dynstate's ~40 modules again
    # (~0.09 s). The untimed first runs below write it, as an installation would have it.
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    print(f"\npython {sys.version.split()[0]}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats} fresh processes")  # fmt: skip
    if not args.no_local:
        local_runs(stores, args.repeats, env)
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
        for n in sizes if args.header_ab is not None else []:
            header_ab(server, f"s3://{BUCKET}/store-{n}", args.header_ab, max(args.repeats, 15))
        if not args.delta:
            return
        for n in sizes:
            table = build_delta(root / f"delta-{n}", n)
            fs.put(str(table) + "/", f"{BUCKET}/delta-{n}/", recursive=True)
            print(f"\n  {n:,} versions:")
            side_by_side(server, f"s3://{BUCKET}/store-{n}", f"s3://{BUCKET}/delta-{n}",
                         args.repeats, env, args.show_requests)  # fmt: skip


if __name__ == "__main__":
    main()
