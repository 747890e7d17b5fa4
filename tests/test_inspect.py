"""`dynstate inspect` on a checkpoint written by the resume harness names the right store,
version and position, and shows exactly the batch the resumed run sees next."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dynstate import StateMismatchError, Store, find_sampler_state
from dynstate.cli import cli
from dynstate.loading.checkpoint import describe_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import resume_harness as h


@pytest.mark.parametrize("mode", ["epoch", "mix"])
def test_inspect_names_version_position_and_next_batch(tmp_path, mode):
    cfg = h.Config(url=str(tmp_path / "store"), steps=7, batch_size=3, mode=mode, ckpt_every=3)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    h.train(cfg, ckpt_dir=str(ckpt), stop_after=3)
    state = find_sampler_state(torch.load(ckpt / "latest.pt", weights_only=True))
    resumed = h.train(dataclasses.replace(cfg, steps=5), ckpt_dir=str(ckpt), resume=True)

    result = CliRunner().invoke(cli, ["inspect", str(ckpt / "latest.pt"), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["store_id"] == Store.open(cfg.url).store_id
    assert (info["version"], info["position"], info["epoch"]) == (
        state["version"],
        state["position"],
        state["epoch"],
    )
    assert [row["id"] for row in info["next_rows"]] == resumed[4]

    table = CliRunner().invoke(cli, ["inspect", str(ckpt)])
    assert table.exit_code == 0 and f"pinned version {state['version']}," in table.output


def test_inspect_refuses_a_file_without_sampler_state(tmp_path):
    torch.save({"step": 3}, tmp_path / "data.pt")
    with pytest.raises(StateMismatchError, match="no dynstate sampler state"):
        describe_checkpoint(str(tmp_path))
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "data.pt")])
    assert result.exit_code == 1 and "error:" in result.output
