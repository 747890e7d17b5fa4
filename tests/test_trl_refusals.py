"""dynstate.trl's start-up and resume refusals for the generation settings (issue 43.1), in
process with the example's tiny model: ``filter_groups`` with a generation spanning several
optimizer steps, and a checkpoint resumed with another number of optimizer steps per
generation; each refused with the setting named and the store unchanged."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

# pytest puts tests/ on sys.path (no package): the tiny-model helpers of test_trl.py
from test_trl import _example, _new_store, _trainer

from dynstate import InvalidDataError, StateMismatchError, Store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


def test_filter_groups_with_a_generation_of_several_steps_is_refused(example, tmp_path) -> None:
    store = _new_store(example, tmp_path / "store")
    with pytest.raises(
        InvalidDataError,
        match=re.escape("filter_groups with steps_per_generation=1 x num_iterations=2"),
    ):
        _trainer(example, store, tmp_path / "out", filter_groups=True,
                 config={"num_iterations": 2})  # fmt: skip
    assert store.refresh() == 1


def test_filter_groups_with_loader_workers_is_refused(example, tmp_path) -> None:
    store = _new_store(example, tmp_path / "store")
    with pytest.raises(InvalidDataError, match=re.escape("dataloader_num_workers=2")):
        _trainer(example, store, tmp_path / "out", filter_groups=True,
                 config={"dataloader_num_workers": 2})  # fmt: skip
    assert store.refresh() == 1


@pytest.mark.parametrize(("saved", "resumed"), [({}, {"num_iterations": 2}),
                                                ({"num_iterations": 2}, {})])  # fmt: skip
def test_checkpoint_of_another_generation_length_is_refused_unchanged(
    example, tmp_path: Path, saved: dict[str, Any], resumed: dict[str, Any]
) -> None:
    """A checkpoint counts dynstate steps in generations: resumed with another
    steps_per_generation x num_iterations / gradient_accumulation_steps, its rounds would be
    misread; refused before the rollback."""
    store = _new_store(example, tmp_path / "store")
    _trainer(example, store, tmp_path / "out", config=saved).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "dynstate_state.pt").is_file()
    head = store.refresh()
    trainer = _trainer(example, Store.open(str(tmp_path / "store")), tmp_path / "again",
                       config=resumed)  # fmt: skip
    with pytest.raises(StateMismatchError, match=r"optimizer step\(s\) per generation"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert store.refresh() == head
