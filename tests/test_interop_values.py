"""Values one writer could store that a reader (this dynstate through another handle, a
strict RFC 8259 JSON parser, ``torch.load(..., weights_only=True)``, the writer's own resume)
would not read back identically: each is refused where it is given, with a DynstateError and
the store unchanged, or written so that every reader reads it alike."""

from __future__ import annotations

import io
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner

from dynstate import (
    DynamicSampling,
    FilterRule,
    FunctionPolicy,
    InvalidDataError,
    Store,
    VersionedDataset,
    VersionedSampler,
    version_at_step,
)
from dynstate.cli import cli
from dynstate.store import MAX_LEASE_TTL_S


def _files(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


def _strict_loads(text: str | bytes) -> Any:
    """RFC 8259: no NaN, Infinity or -Infinity (what JS, Go, serde_json and jq refuse)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not RFC 8259 JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _store(tmp_path: Path, rows: int = 16) -> tuple[Store, str]:
    url = str(tmp_path / "store")
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(rows)])
    return store, url


def _weights(stats: pa.Table, step: int) -> list[float]:  # module level: a stable name
    return [1.0] * stats.num_rows


def _keep(scores: list[float]) -> bool:
    return len(set(scores)) > 1


def _score(items: list[dict[str, Any]], step: int) -> list[list[float]]:
    return [[1.0, 0.0, float(item["id"] % 2), 1.0] for item in items]


def _dynamic(url: str, rule: Any = "zero_variance", select: Any = None) -> DynamicSampling:
    dataset = VersionedDataset(url)
    sampler = VersionedSampler(dataset, seed=0, select=select)
    return DynamicSampling(
        dataset, sampler, gen_batch_size=4, train_groups=2, rule=rule, max_gen_batches=4
    )


# -- outcomes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcomes",
    [
        [{"row": 0, "step": 1, "score": 2**53 + 1}],
        {"row": [0], "step": [1], "score": np.array([2**62], dtype=np.int64)},
        pa.table({"row": [0], "step": [1], "score": pa.array([2**63], pa.uint64())}),
    ],
    ids=["python-int", "numpy-int64", "arrow-uint64"],
)
@pytest.mark.parametrize("via", ["append", "pending"])
def test_an_integer_score_a_float64_cannot_hold_is_a_typed_error(tmp_path, outcomes, via):
    """An integer score a float64 cannot hold exactly (beyond 2**53, though inside the
    bound |score| <= 1e250) is an InvalidDataError naming the score, not pyarrow's
    ArrowInvalid, and the store is unchanged."""
    store, url = _store(tmp_path, rows=4)
    before = _files(url)
    with pytest.raises(InvalidDataError, match="score"):
        if via == "append":
            store.append([], outcomes=outcomes)
        else:
            store.outcome_stats(pending=outcomes)
    assert _files(url) == before
    assert Store.open(url).head == 1


# -- sampler state ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"fresh_share": 0.0},
        {"fresh_share": math.nan},
        {"fresh_share": None},
        {"fresh_share": np.float32(0.5)},
        {"lag": None},
        {"mode": "mix", "batch_size": 2, "fresh_share": True},
    ],
    ids=[
        "epoch-share-0",
        "epoch-share-nan",
        "epoch-share-none",
        "epoch-share-float32",
        "epoch-lag-none",
        "mix-share-True",
    ],
)
def test_a_sampler_never_writes_a_state_it_cannot_load(tmp_path, settings) -> None:
    """``fresh_share`` and ``lag`` are checked at construction in every mode: the state
    records both and its check refuses in every mode what it cannot hold, so a sampler built
    with them would write a state that its own ``load_state_dict`` refuses (0.0, NaN, None,
    True) or that ``torch.load(weights_only=True)`` cannot read (np.float32, SPEC §3.11)."""
    _, url = _store(tmp_path, rows=8)
    with pytest.raises(InvalidDataError, match=r"fresh_share|lag"):
        VersionedSampler(VersionedDataset(url), seed=0, **settings)


def test_a_sampler_state_loads_with_weights_only_into_the_same_sampler(tmp_path) -> None:
    """The state of a sampler built with the defaults and with numpy ints is plain: it
    survives ``torch.load(weights_only=True)`` and loads into the same sampler."""
    _, url = _store(tmp_path, rows=8)
    for settings in ({}, {"lag": np.int64(2), "fresh_share": 0.25}):
        sampler = VersionedSampler(VersionedDataset(url), seed=0, **settings)
        next(iter(sampler))
        buffer = io.BytesIO()
        torch.save(sampler.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        VersionedSampler(VersionedDataset(url), seed=0, **settings).load_state_dict(state)


def test_a_policy_with_a_lone_surrogate_is_refused_at_construction() -> None:
    """A str UTF-8 cannot encode (a lone surrogate) in a policy's params or name is refused
    when the policy is made (the one plain-value rule, records/inputs.py), not at the first
    step's commit, where the sampler state carries it into JSON records."""
    with pytest.raises(InvalidDataError):
        FunctionPolicy(_weights, params={"s": "\ud800"})
    with pytest.raises(InvalidDataError):
        FunctionPolicy(_weights, name="policy\udc80")


# -- filter rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [{"x": math.nan}, {1: "a"}, {"x": np.float32(0.5)}, {"x": "\ud800"}, {"x": 10**5000}],
    ids=["nan", "int-key", "float32", "lone-surrogate", "int-past-the-bound"],
)
def test_filter_rule_params_no_record_can_hold_are_refused_at_construction(params) -> None:
    """A FilterRule's params go into every consumption record (``settings.rule``): a value
    no record can hold is refused when the rule is made, naming its params, as
    FunctionPolicy's are, not at the commit after a whole generation step."""
    with pytest.raises(InvalidDataError, match="params"):
        FilterRule(_keep, name="mine", params=params)


def test_filter_rule_with_tuple_params_commits_or_is_refused_up_front(tmp_path) -> None:
    """Tuple params (``band=(0.1, 0.9)``) are kept as lists, as FunctionPolicy keeps them:
    the step commits and a rule made with the same tuple resumes it."""
    _, url = _store(tmp_path)
    rule = FilterRule(_keep, name="mine", params={"band": (0.1, 0.9)})
    assert rule.params == {"band": [0.1, 0.9]}
    dyn = _dynamic(url, rule=rule)
    dyn.resume(None)
    batch = dyn.next_batch(0, _score)
    Store.open(url).append(
        [], meta={"step": 0}, outcomes=batch.outcomes(), rows_version=batch.rows_version,
        consumption=batch.record,
    )  # fmt: skip
    assert (
        _dynamic(url, rule=FilterRule(_keep, name="mine", params={"band": (0.1, 0.9)})).resume(0)
        == 1
    )


# -- meta["step"] ----------------------------------------------------------------------------


@pytest.mark.parametrize("step", [True, 1.0, np.float64(1.0)], ids=["True", "1.0", "np.float64"])
def test_a_consumption_record_is_refused_unless_meta_step_is_its_int_step(tmp_path, step):
    """A consumption record of step 1 commits only with meta['step'] the int 1: every
    reader (log/steps.py `own_step`) counts only an int as a step, so a record committed
    with True or 1.0 would never be found by ``resume(1)``."""
    store, url = _store(tmp_path)
    dyn = _dynamic(url)
    dyn.resume(None)
    b0 = dyn.next_batch(0, _score)
    store.append([], meta={"step": 0}, outcomes=b0.outcomes(), rows_version=b0.rows_version,
                 consumption=b0.record)  # fmt: skip
    b1 = dyn.next_batch(1, _score)
    before = _files(url)
    with pytest.raises(InvalidDataError, match="step"):
        store.append([], meta={"step": step}, outcomes=b1.outcomes(),
                     rows_version=b1.rows_version, consumption=b1.record)  # fmt: skip
    assert _files(url) == before


@pytest.mark.parametrize(
    "step", [True, 1.0, np.float64(1.0), "1"], ids=["True", "1.0", "np.float64", "str"]
)
def test_a_round_of_step_one_is_not_counted_as_step_zero(tmp_path, step) -> None:
    """A round's meta['step'] is an int or absent. Every reader of steps (`own_step`)
    counts anything else as no step, so a round of step 1.0, True or "1" would be taken as
    part of step 0: a rollback to a step-0 checkpoint would keep it and its outcomes (SPEC
    §3.6). It is refused, the store unchanged."""
    store, url = _store(tmp_path, rows=4)
    zero = store.append([{"id": 100}], meta={"step": 0})
    before = _files(url)
    with pytest.raises(InvalidDataError, match="step"):
        store.append([{"id": 101}], meta={"step": step},
                     outcomes=[{"row": 0, "step": 1, "score": 1.0}])  # fmt: skip
    assert _files(url) == before
    assert version_at_step(Store.open(url), 0) == zero


# -- key order -------------------------------------------------------------------------------


def test_meta_and_generator_state_read_back_alike_on_every_handle(tmp_path) -> None:
    """The writing handle reads meta and a generator state back with their keys in the
    order every other handle reads them from the record (sorted): a generator that iterates
    its state's dicts (tasks -> weights) draws alike before and after a resume."""
    store, url = _store(tmp_path, rows=2)
    version = store.append([{"id": 9}], meta={"z": 1, "a": 2},
                           generator_state={"tasks": {"zeta": 0.5, "alpha": 0.5}})  # fmt: skip
    other = Store.open(url)
    assert list(store.commit_record(version).meta) == list(other.commit_record(version).meta)
    assert list(store.generator_state(version)["tasks"]) == list(
        other.generator_state(version)["tasks"]
    )


# -- leases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [math.inf, 1e300], ids=["inf", "1e300"])
def test_a_lease_ttl_is_refused_or_written_as_strict_json(tmp_path, ttl, monkeypatch) -> None:
    """A lease ttl is bounded at open: an infinite one would be written as
    ``"ttl_s":Infinity``, which no strict JSON reader parses, and an infinite or huge one
    kills the heartbeat thread (threading's wait is bounded by TIMEOUT_MAX). The largest
    allowed ttl writes strict JSON and a heartbeat that lives."""
    _, url = _store(tmp_path, rows=2)
    with pytest.raises(InvalidDataError, match="lease_ttl_s"):
        Store.open(url, lease_ttl_s=ttl)
    crashes: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    store = Store.open(url, lease_ttl_s=MAX_LEASE_TTL_S)
    part = store.stage([{"id": 5}])
    time.sleep(0.5)  # the heartbeat thread starts and waits ttl / 4
    try:
        for name, data in _files(url).items():
            if name.endswith(".json"):
                _strict_loads(data)
    finally:
        store.commit_staged([part])
    assert not crashes, crashes


# -- the CLI's --json ------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--jsonl"])
def test_cli_json_of_rows_is_strict_json(tmp_path, flag) -> None:
    """`dynstate head --json/--jsonl` prints strict JSON: a float column's NaN or infinity
    (which Arrow and Parquet store) comes out as null, as `dynstate serve`'s API gives it,
    not as ``NaN``/``Infinity``, which jq, JavaScript, Go and serde_json refuse."""
    url = str(tmp_path / "store")
    Store.open(url, create=True).append([{"x": math.nan, "y": math.inf, "z": 1.5}])
    result = CliRunner().invoke(cli, ["head", url, flag])
    assert result.exit_code == 0, result.output
    lines = [result.output] if flag == "--json" else result.output.splitlines()
    for line in lines:
        _strict_loads(line)


def test_a_record_with_nan_is_refused_naming_finite_numbers() -> None:
    """The last line, under every input check: the codec writes RFC 8259 JSON only, and says
    why when asked to write NaN or an infinity."""
    from dynstate.records.codec import encode

    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidDataError, match="finite numbers"):
            encode({"ttl_s": value})
    assert _strict_loads(encode({"x": -0.0, "y": 1e308}))["y"] == 1e308


@pytest.mark.parametrize(
    "scores",
    [
        [np.float32(0.5), np.float64(1.0), np.int64(0)],
        [torch.tensor(0.5), torch.tensor(1), np.array(0.25)],
    ],
    ids=["numpy-scalars", "0-d-tensors"],
)
def test_a_score_function_may_return_numpy_and_0d_tensor_scores(tmp_path, scores) -> None:
    """A reward function's numbers as frameworks give them (numpy scalars, 0-d tensors) are
    scores, stored as the floats they hold, and the step commits; a bool, a str or a
    many-element tensor is refused naming the row."""
    store, url = _store(tmp_path)
    dyn = _dynamic(url)
    dyn.resume(None)
    batch = dyn.next_batch(0, lambda items, step: [[*scores, 1.0] for _ in items])
    assert list(batch.groups[0].scores) == [*(float(s) for s in scores), 1.0]
    store.append(
        [], meta={"step": 0}, outcomes=batch.outcomes(), rows_version=batch.rows_version,
        consumption=batch.record,
    )  # fmt: skip
    _, other = _store(tmp_path / "other")
    for bad in (True, "1.0", torch.tensor([0.5, 1.0]), np.bool_(True), torch.tensor(True)):
        dyn = _dynamic(other)
        dyn.resume(None)
        with pytest.raises(InvalidDataError, match="scores of row"):
            dyn.next_batch(0, lambda items, step, bad=bad: [[bad, 0.0] for _ in items])
