"""Screenshots of `dynstate serve` for docs/serve.md: a 40-step run with two generators, a
crash rolled back, a lost round, empty rounds and a compaction, shown in headless Chromium.

    python tools/serve_screenshot.py docs/           # writes serve-store.png, serve-row.png
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
import time

import pyarrow as pa
import uvicorn

from dynstate import Store, rollback
from dynstate.maintenance.compact import compact
from dynstate.serve.api import StoreView
from dynstate.serve.app import create_app
from dynstate.serve.command import address, bind

SCHEMA = pa.schema(
    [
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("difficulty", pa.int64()),
        ("_dynstate_source", pa.list_(pa.int64())),
    ]
)


def build(url: str) -> Store:
    rng = random.Random(7)
    store = Store.open(url, create=True)
    seed = [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b), "difficulty": 1,
         "_dynstate_source": None}
        for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(48))
    ]  # fmt: skip
    store.append(pa.Table.from_pylist(seed, SCHEMA), meta={"step": -1, "generator": "initial"})
    step, crashed = 0, False
    while step < 40:
        if step == 26 and not crashed:
            crashed = True  # the run died after step 25; its last checkpoint is step 21
            rollback(store, step=21, meta={"reason": "resume from global_step_21"})
            store.append([], meta={"step": 22, "generator": "lost:proposer", "lost": True})
            step = 23
        if step == 31:
            compact(store, target_bytes=2**20)
        n = store.snapshot().num_rows
        size = 0 if step in (9, 17) else rng.randrange(3, 14)
        gen = "proposer" if step % 3 else "mutator"
        rows = []
        for _ in range(size):
            src = sorted(rng.sample(range(max(0, n - 40), n), rng.randrange(1, 3)))
            a, b = rng.randrange(1000), rng.randrange(1000)
            rows.append(
                {"prompt": f"What is {a} * {b}? (harder variant of {src})",
                 "answer": str(a * b), "difficulty": 2 + len(src), "_dynstate_source": src}
            )  # fmt: skip
        store.append(pa.Table.from_pylist(rows, SCHEMA), meta={"step": step, "generator": gen})
        if step == 20:
            store.tag("global_step_21", store.head)
        step += 1
    return store


def main(out_dir: str) -> None:
    out_dir = os.path.abspath(out_dir)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        store = build("runs/run1")
        sock = bind("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(create_app(StoreView(store)), log_level="warning"))
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
            page.goto(base + "/")
            page.screenshot(path=os.path.join(out_dir, "serve-store.png"), full_page=True)
            row = store.snapshot().num_rows - 30
            page.goto(f"{base}/versions/head/rows/{row}")
            page.screenshot(path=os.path.join(out_dir, "serve-row.png"))
            browser.close()
        server.should_exit = True
        thread.join()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs")
