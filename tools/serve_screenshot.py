"""Screenshots of `dynstate serve` for docs/serve.md, from a store shaped like a verl run's: a
2,000-row import, 40 steps of rounds of 1-40 rows from two generators, a crash rolled back, a
lost round, empty rounds and a compaction, shown in headless Chromium (Debian's chromium at
/usr/bin/chromium, or $DYNSTATE_CHROMIUM).

    python tools/serve_screenshot.py docs/           # writes serve-store.png, serve-row.png
    python tools/serve_screenshot.py --outcomes docs/
        # the same run with each step's outcomes (32 rows, 4 responses each): writes
        # serve-outcomes.png (rows per pass-rate band per step) and serve-row-outcomes.png
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time

import pyarrow as pa
import uvicorn

from dynstate import Store, rollback
from dynstate.maintenance.compact import compact
from dynstate.serve.api import StoreView
from dynstate.serve.app import create_app
from dynstate.serve.net import address, bind

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("_dynstate_source", pa.list_(pa.int64())),
    ]
)
IMPORT_ROWS, STEPS, MAX_ROUND = 2000, 40, 40


def _row(question: str, answer: str, source: list[int] | None) -> dict:
    return {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "_dynstate_source": source,
    }


def _outcomes(rng: random.Random, n: int, step: int) -> list[dict]:
    """A step's scores: 32 rows of the version trained on, 4 responses each, each row passing
    with a fixed chance of its own (its difficulty)."""
    out = []
    for row in rng.sample(range(n), min(32, n)):
        chance = random.Random(row).random()
        out += [{"row": row, "step": step, "score": float(rng.random() < chance)} for _ in range(4)]
    return out


def build(
    url: str, *, import_rows: int = IMPORT_ROWS, steps: int = STEPS, outcomes: bool = False
) -> Store:
    """A store shaped like a verl run's (what dynstate.verl writes): an import of
    ``import_rows`` rows with no step (verl's parquet files), then one round per training step
    from step 1, of 1-40 rows each with its ``_dynstate_source``; the run crashes after step 25
    and resumes from its checkpoint at step 21 (a rollback), step 22's first round is recorded
    as lost, steps 9 and 17 generate nothing, and a compaction runs at step 31. ``outcomes``:
    each round also records its step's outcomes (the rows are the same either way)."""
    rng = random.Random(7)
    scores = random.Random(11)  # its own stream: the rows do not depend on ``outcomes``
    store = Store.open(url, create=True)
    seed = []
    for _ in range(import_rows):
        a, b = rng.randrange(100), rng.randrange(100)
        seed.append(_row(f"What is {a} + {b}?", str(a + b), None))
    files = ["~/data/arith/train.parquet"]
    store.append(pa.Table.from_pylist(seed, SCHEMA), meta={"verl_import": True, "files": files})
    step, crashed = 1, False
    while step <= steps:
        if step == 26 and not crashed:
            crashed = True  # the run died after step 25; its last checkpoint is step 21
            rollback(store, step=21, meta={"verl_resume_step": 21})
            store.append([], meta={"step": 22, "generator": "lost:proposer", "lost": True})
            step = 23
        if step == 31:
            compact(store, target_bytes=2**20)
        n = store.snapshot().num_rows
        size = 0 if step in (9, 17) else rng.randrange(1, MAX_ROUND + 1)
        gen = "proposer" if step % 3 else "mutator"
        rows = []
        for _ in range(size):
            src = sorted(rng.sample(range(max(0, n - 400), n), rng.randrange(1, 3)))
            a, b = rng.randrange(1000), rng.randrange(1000)
            rows.append(_row(f"What is {a} * {b}? (a harder variant of {src})", str(a * b), src))
        meta = {"step": step, "generator": gen, "rows": size}
        scored = _outcomes(scores, n, step) if outcomes else None
        store.append(pa.Table.from_pylist(rows, SCHEMA), meta=meta, outcomes=scored)
        if step == 21:
            store.tag("global_step_21", store.head)
        step += 1
    return store


def pick_row(view: StoreView) -> int:
    """A generated row with both ancestors and descendants, for the lineage screenshot."""
    head = view.store.snapshot()
    best, score = head.num_rows - 1, -1
    for row in range(IMPORT_ROWS + 300, min(head.num_rows, IMPORT_ROWS + 500), 5):
        detail = view.row_detail("head", row)
        up, down = len(detail["ancestors"]), len(detail["descendants"])
        if up and down and min(up, 4) + min(down, 6) > score:
            best, score = row, min(up, 4) + min(down, 6)
    return best


def main(out_dir: str, *, outcomes: bool = False) -> None:
    out_dir = os.path.abspath(out_dir)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        store = build("runs/run1", outcomes=outcomes)
        view = StoreView(store)
        sock = bind("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(create_app(view), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        base = address(sock)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=os.environ.get("DYNSTATE_CHROMIUM", "/usr/bin/chromium"),
                args=["--no-sandbox", "--disable-background-networking", "--headless"],
            )
            page = browser.new_page(viewport={"width": 1240, "height": 900})
            if outcomes:
                page.goto(base + "/outcomes")
                page.screenshot(path=os.path.join(out_dir, "serve-outcomes.png"), full_page=True)
                stats = store.outcome_stats().to_pydict()
                row = max(range(len(stats["row"])), key=lambda i: (stats["attempts"][i], -i))
                page.goto(f"{base}/versions/head/rows/{row}")
                page.screenshot(path=os.path.join(out_dir, "serve-row-outcomes.png"))
                browser.close()
                server.should_exit = True
                thread.join()
                return
            page.goto(base + "/")
            page.screenshot(path=os.path.join(out_dir, "serve-store.png"), full_page=True)
            row = pick_row(view)
            page.goto(f"{base}/versions/head/rows/{row}")
            page.screenshot(path=os.path.join(out_dir, "serve-row.png"))
            browser.close()
        server.should_exit = True
        thread.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="docs", help="where the PNGs go")
    parser.add_argument(
        "--outcomes", action="store_true", help="the run with outcomes, and its two pictures"
    )
    cli = parser.parse_args()
    main(cli.out_dir, outcomes=cli.outcomes)
