"""A missing checkpoint file is a ``CheckpointNotFoundError`` (also a ``FileNotFoundError``)
naming the path and what to pass — for the verl resume's ``data.pt`` and for the checkpoint
inspection both trainers' folders are read with (issue 20.9); the store is left alone."""

from __future__ import annotations

import os

import pytest

import dynstate
from dynstate.errors import CheckpointNotFoundError, StoreNotFoundError


def test_missing_data_pt_of_a_verl_resume_is_checkpoint_not_found(tmp_path):
    from dynstate.verl import read_loader_state

    store = dynstate.Store.open(str(tmp_path / "s"), create=True)
    store.append([{"x": 1}])
    path = str(tmp_path / "ckpt" / "global_step_4" / "data.pt")
    with pytest.raises(CheckpointNotFoundError) as err:
        read_loader_state(path, store)
    assert isinstance(err.value, FileNotFoundError)
    assert not isinstance(err.value, StoreNotFoundError)
    assert path in str(err.value) and "restore the file" in str(err.value)
    assert store.refresh() == 1


@pytest.mark.parametrize("kind", ["folder without data.pt", "no such path"])
def test_missing_checkpoint_to_inspect_is_checkpoint_not_found(tmp_path, kind):
    from dynstate.loading.checkpoint import load_checkpoint_state

    path = str(tmp_path / "global_step_2")
    if kind == "folder without data.pt":
        os.makedirs(path)
    with pytest.raises(CheckpointNotFoundError) as err:
        load_checkpoint_state(path)
    assert isinstance(err.value, FileNotFoundError)
    assert path in str(err.value) and "global_step_N" in str(err.value)
