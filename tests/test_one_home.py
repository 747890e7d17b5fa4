"""One home for the outcome rules (issue 41.1): a success, a pass rate and its band are
written in ``dynstate/records/aggregate.py`` only, and every other module asks it, so
``dynstate stats``, serve's charts and the selection policies can never disagree. An AST
scan of the package fails when a second copy creeps back; it first proves on aggregate.py
itself that it finds such code. And the one input converter takes outcome columns as real
torch tensors and numpy arrays, as a training loop has them."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dynstate import Store, VersionedDataset
from dynstate.errors import InvalidDataError

PACKAGE = Path(__file__).resolve().parents[1] / "dynstate"
HOME = PACKAGE / "records" / "aggregate.py"
# The rules' functions: defined once, in the home.
RULES = {"succeeded", "pass_rate", "pass_rates", "band_of", "band_counts", "tally", "summarize"}
THRESHOLDS = {"success_above", "above", "threshold"}
COUNTS = ("success", "won", "wins", "passed")  # what a pass rate divides


def _names(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            found.add(sub.value)  # entry["successes"]
    return found


def _counts(node: ast.AST) -> bool:
    return any(part in name.lower() for name in _names(node) for part in COUNTS)


def rule_copies(path: Path) -> list[str]:
    """Where ``path`` decides a success, a pass rate or a band itself."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in RULES:
            found.append(f"{where}: defines {node.name}()")
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Gt, ast.GtE, ast.Lt, ast.LtE)) for op in node.ops
        ):
            if _names(node) & THRESHOLDS:
                found.append(f"{where}: a success ({ast.unparse(node)})")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            if _counts(node.left):
                found.append(f"{where}: a pass rate ({ast.unparse(node)})")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            sides = (_names(node.left), _names(node.right))
            counted = any("rate" in n or any(c in n.lower() for c in COUNTS)
                          for s in sides for n in s)  # fmt: skip
            if any("bins" in s for s in sides) and counted:
                found.append(f"{where}: a band ({ast.unparse(node)})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("divide", "true_divide")
            and node.args
            and _counts(node.args[0])
        ):
            found.append(f"{where}: a pass rate ({ast.unparse(node)})")
    return found


def test_the_scan_finds_the_rules_in_their_home() -> None:
    found = "\n".join(rule_copies(HOME))
    for what in ("defines succeeded()", "defines pass_rate()", "defines band_of()"):
        assert what in found, found
    assert "a success (scores > success_above)" in found, found
    assert "a pass rate (np.divide(successes, attempts" in found, found
    assert "a band (successes * bins)" in found, found


def test_no_module_but_aggregate_decides_a_success_a_pass_rate_or_a_band() -> None:
    copies = [
        hit for path in sorted(PACKAGE.rglob("*.py")) if path != HOME for hit in rule_copies(path)
    ]
    assert not copies, "ask dynstate.records.aggregate instead:\n" + "\n".join(copies)


def test_the_surfaces_and_the_policies_use_the_same_functions() -> None:
    from dynstate.history import outcomes as views
    from dynstate.loading import selection
    from dynstate.records import aggregate

    assert selection.pass_rates is aggregate.pass_rates
    assert views.band_of is aggregate.band_of


# -- the one input converter: tensors and numpy as a training loop has them ---------------


def _store(tmp_path: Path) -> Store:
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"prompt": f"p{i}"} for i in range(6)])
    return store


def test_outcomes_from_a_default_collated_batch_of_tensors(tmp_path: Path) -> None:
    store = _store(tmp_path)
    loader = DataLoader(VersionedDataset(store, row_column="_dynstate_row"), batch_size=4)
    batch = next(iter(loader))  # default collation: the row numbers arrive as a tensor
    assert isinstance(batch["_dynstate_row"], torch.Tensor)
    scores = torch.tensor([1.0, 0.0, 0.75, 0.25], dtype=torch.float32)
    step = torch.full((4,), 7)
    store.append([], outcomes={"row": batch["_dynstate_row"], "step": step, "score": scores})
    # the same outcomes as numpy arrays, and as rows of 0-d tensors and numpy scalars
    twin = _store(tmp_path / "twin")
    twin.append([], outcomes={"row": np.arange(4), "step": np.full(4, 7), "score": scores.numpy()})
    third = _store(tmp_path / "third")
    third.append(
        [],
        outcomes=[
            {"row": torch.tensor(r), "step": np.int64(7), "score": np.float32(s)}
            for r, s in zip(range(4), scores.tolist(), strict=True)
        ],
    )
    want = {"row": [0, 1, 2, 3], "step": [7] * 4, "score": [1.0, 0.0, 0.75, 0.25]}
    for each in (store, twin, third):
        got = each.outcome_records().select(["row", "step", "score"]).to_pydict()
        assert got == want
        assert each.outcome_stats().column("successes").to_pylist() == [1, 0, 1, 0, 0, 0]


def test_outcome_columns_of_more_dimensions_or_bad_values_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with pytest.raises(InvalidDataError, match="'score' has 2 dimensions"):
        store.append([], outcomes={"row": [0], "step": [0], "score": torch.ones(1, 1)})
    with pytest.raises(InvalidDataError, match="must be numbers"):
        store.append([], outcomes={"row": [0], "step": [0], "score": torch.tensor([True])})
    assert store.head == 1
