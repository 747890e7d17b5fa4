"""`dynstate inspect` and serve's checkpoint page open checkpoints of curriculum runs: the
built-in policies are rebuilt from the sampler state, and the next batch shown is the one the
resumed loader draws; a user function's checkpoint shows its recorded identity and a note."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from torchdata.stateful_dataloader import StatefulDataLoader

from dynstate import (
    DifficultyPools,
    FunctionPolicy,
    Learnability,
    PassRateBand,
    StateMismatchError,
    Store,
    VersionedDataset,
    VersionedSampler,
)
from dynstate.cli import cli
from dynstate.loading.checkpoint import describe_checkpoint

ROWS = 40
BATCH = 4


def _by_row(stats: pa.Table, step: int) -> np.ndarray:
    return np.arange(stats.num_rows, dtype=np.float64) + 1.0


POLICIES: dict[str, Any] = {
    "band": lambda: PassRateBand(0.2, 0.8),
    "learnability": lambda: Learnability(floor=0.05),
    "pools": lambda: DifficultyPools(
        bounds=[0.5], names=["hard", "easy"], shares=[0.75, 0.25], unseen="hard"
    ),
    "dict-config": lambda: {"policy": "learnability", "floor": 0.02},
}


def _store(url: str) -> Store:
    store = Store.open(url, create=True)
    store.append([{"id": i, "prompt": f"task {i}"} for i in range(ROWS)])
    # Pass rates spread over (0, 1): row i passes (i % 5) of 4 tries (rows with i % 5 == 4
    # always pass), so every policy has rows in and out of its band or pool.
    records = [
        {"row": i, "step": 0, "score": 1.0 if k < i % 5 else 0.0}
        for i in range(ROWS)
        for k in range(4)
    ]
    store.append([], meta={"step": 0}, outcomes=records)
    return store


def _loader(store: Store, select: Any) -> StatefulDataLoader:
    dataset = VersionedDataset(store)
    sampler = VersionedSampler(dataset, seed=3, batch_size=BATCH, select=select)
    return StatefulDataLoader(
        dataset, batch_size=BATCH, sampler=sampler, collate_fn=lambda rows: rows
    )


def _checkpoint(tmp_path: Path, select: Any, steps: int = 3) -> tuple[Path, list[int]]:
    """A verl-style global_step_N/data.pt after ``steps`` batches, and the ids of the rows the
    resumed loader's next batch holds (the oracle: a fresh loader loading the state)."""
    store = _store(str(tmp_path / "store"))
    loader = _loader(store, select)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    folder = tmp_path / "ckpt" / f"global_step_{steps}"
    folder.mkdir(parents=True)
    torch.save(loader.state_dict(), folder / "data.pt")
    resumed = _loader(Store.open(str(tmp_path / "store")), select)
    resumed.load_state_dict(torch.load(folder / "data.pt", weights_only=True))
    return folder, [row["id"] for row in next(iter(resumed))]


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_inspect_rebuilds_built_in_policies(tmp_path, kind):
    select = POLICIES[kind]()
    folder, expected = _checkpoint(tmp_path, select)
    info = describe_checkpoint(str(folder), rows=BATCH)
    assert "next_error" not in info
    assert [row["id"] for row in info["next_rows"]] == expected
    assert info["select"]["policy"] == (
        select["policy"] if isinstance(select, dict) else select.name
    )

    # The installed CLI, as a user runs it, both as JSON and as a table.
    out = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "dynstate"),
            "inspect",
            str(folder),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert [row["id"] for row in json.loads(out.stdout)["next_rows"][:BATCH]] == expected
    table = CliRunner().invoke(cli, ["inspect", str(folder)])
    assert table.exit_code == 0, table.output
    assert "selection" in table.output and info["select"]["policy"] in table.output


def test_inspect_function_policy_shows_its_identity_without_importing_it(tmp_path):
    policy = FunctionPolicy(_by_row, name="tests.never_imported:policy", params={"k": 2})
    folder, _ = _checkpoint(tmp_path, policy)
    info = describe_checkpoint(str(folder), rows=BATCH)
    assert info["select"] == policy.identity()
    assert info["next_rows"] == []
    assert "does not import" in info["next_error"]
    result = CliRunner().invoke(cli, ["inspect", str(folder)])
    assert result.exit_code == 0, result.output
    assert "tests.never_imported:policy" in result.output and "does not import" in result.output


def test_inspect_refuses_a_policy_state_that_does_not_rebuild(tmp_path):
    folder, _ = _checkpoint(tmp_path, Learnability())
    state = torch.load(folder / "data.pt", weights_only=True)
    # Find the sampler state wherever the loader put it, and damage its policy parameters.
    from dynstate import find_sampler_state

    found = find_sampler_state(state)
    assert found is not None
    found["select"]["params"]["floor"] = "high"
    torch.save(state, folder / "data.pt")
    with pytest.raises(StateMismatchError, match="cannot be rebuilt"):
        describe_checkpoint(str(folder))
    result = CliRunner().invoke(cli, ["inspect", str(folder)])
    assert result.exit_code == 1 and "error:" in result.output


def test_serve_checkpoint_page_of_a_curriculum_run(tmp_path):
    from test_serve import Client, served

    from dynstate.serve.api import StoreView

    folder, expected = _checkpoint(tmp_path, Learnability(floor=0.05))
    store = Store.open(str(tmp_path / "store"))
    view = StoreView(store, checkpoints=[str(folder)], url=str(tmp_path / "store"))
    with served(view) as base:
        client = Client(base)
        info = client.json("/api/checkpoints/0")
        assert info["select"]["policy"] == "learnability"
        assert [row["id"] for row in info["next_batches"][0]["values"]] == expected
        status, body = client.get("/checkpoints/0")
        assert status == 200 and "Next batches" in body
