"""Stateful generators' state, attacked from outside (an audit of SPEC §3.13 with §3.11, §3.12
and §3.17): ``generator_state`` committed with its round, read back at every version exactly
(type included) or refused at commit with a typed error that names it and leaves every file of
the store as it was; the state of a version after later versions, resets, compaction and gc
equal to a fold of the raw commit records by hand; a generator resumed through TRL's real
``train()`` and verl's real ``fit()`` (the CPU drivers of tests/test_trl.py and
tests/test_verl.py), also after a SIGKILL between a round's commit and its checkpoint, handed
exactly the state of the checkpointed version; generators whose ``state_dict`` raises, returns
what JSON cannot hold or changes after it returned, and a ``load_state_dict`` that raises.

The oracle is the store's raw files (``_dynstate/log/*.json`` read with :mod:`json`) and the
values committed. Tests whose docstring starts with "DEFECT (fixed):" each failed on the code
before its fix (the docstring tells the defect as found); the others guard what held up."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dynstate
from dynstate import InvalidDataError, Store, collect_garbage, compact
from dynstate.generators import load_state

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# -- the oracle: strict equality and the raw records ---------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal with the same type at every level (a float's sign of zero included); dict key
    order is not compared (the docs say dicts read back with their keys sorted)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def files(root: Path) -> dict[str, bytes]:
    """Every file of a local store with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def raw_records(root: Path) -> dict[int, dict[str, Any]]:
    """The commit records, parsed with json alone."""
    out = {}
    for path in (root / "_dynstate" / "log").glob("*.json"):
        record = json.loads(path.read_text(encoding="utf-8"))
        out[int(record["version"])] = record
    return out


def folded_state(records: dict[int, dict[str, Any]], version: int) -> Any:
    """The state of ``version`` by the docs' rule, folded by hand: the newest
    ``generator_state`` walking parents back, stopping at a record that stands alone
    (create, reset, compaction: it holds its source's state, or none)."""
    v: int | None = version
    while v is not None:
        record = records[v]
        if "generator_state" in record:
            return record["generator_state"]
        if record["op"] != "append":
            return None
        v = record["parent"]
    return None


def read_states_elsewhere(root: Path, versions: list[int], env: dict[str, str] | None = None):
    """``Store.generator_state(v)`` of each version, read by a fresh process (pickled back)."""
    code = textwrap.dedent(
        """
        import pickle, sys
        from dynstate import Store
        store = Store.open(sys.argv[1])
        out = {int(v): store.generator_state(int(v)) for v in sys.argv[2:]}
        sys.stdout.buffer.write(pickle.dumps(out))
        """
    )
    done = subprocess.run(
        [PY, "-c", code, str(root), *map(str, versions)],
        capture_output=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return pickle.loads(done.stdout)


def new_store(root: Path) -> Store:
    store = Store.open(str(root), create=True)
    store.append([{"x": 0}, {"x": 1}])
    return store


def scored(step: int) -> dict[str, list[Any]]:
    return {"row": [0, 1], "step": [step, step], "score": [0.25, 1.0]}


# -- values: exactly back, in a later process ---------------------------------------------------

ACCEPTED: dict[str, Any] = {
    "nested": {"a": {"b": [1, [2, {"c": None, "d": [True, False]}]], "e": "x"}},
    "ints": {
        "past_2_53": 2**53 + 1,
        "past_2_63": 2**63 + 7,
        "past_2_64": -(2**64) - 3,
        "long": 10**4299 + 1,
        "negative_long": -(10**4300 - 1),
    },
    "floats": {
        "neg_zero": -0.0,
        "tiny": 5e-324,
        "huge": 1.7976931348623157e308,
        "tenth": 0.1,
        "third": 1 / 3,
    },
    "text": {"k\x00ey": "v\x00al", "": "", "\u2028": "\U0001f600", 'quote"\\': '\\"'},
    "numpy_rng": np.random.default_rng(12345).bit_generator.state,
    "deep_32": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    "near_1_mib": {"blob": "y" * (2**20 - 64)},
    "empty_dict": {},
    "top_list": [1, "a", None, 2.5],
    "top_zero": 0,
    "top_false": False,
    "top_empty_str": "",
    "top_empty_list": [],
    "top_negative_zero": -0.0,
}


def test_plain_states_come_back_exactly_at_their_versions_in_a_fresh_process(tmp_path):
    """Each accepted value (ints past 2**53, 2**63 and to the 4,300-digit bound, -0.0, NUL and
    line-separator text, a numpy Generator's bit_generator.state, 32 levels, ~1 MiB, falsy
    top-level states) reads back equal with its types, in this handle, a fresh handle and a
    fresh process (one with a 640-digit int limit for the long ints), at its own version and
    at the stateless version after it; the raw record holds the same value."""
    root = tmp_path / "s"
    store = new_store(root)
    at: dict[str, tuple[int, int]] = {}
    for step, (name, value) in enumerate(ACCEPTED.items(), start=1):
        v = store.append([], meta={"step": step}, outcomes=scored(step), generator_state=value)
        after = store.append([{"x": step + 1}])  # commits no state: the lineage's is kept
        at[name] = (v, after)
    wanted = [v for pair in at.values() for v in pair]
    elsewhere = read_states_elsewhere(root, wanted)
    fresh = Store.open(str(root))
    records = raw_records(root)
    for name, value in ACCEPTED.items():
        v, after = at[name]
        for reader in (store, fresh):
            for version in (v, after):
                assert same(reader.generator_state(version), value), (name, version)
        assert same(elsewhere[v], value) and same(elsewhere[after], value), name
        assert same(records[v]["generator_state"], value), name
        assert "generator_state" not in records[after]
        assert same(folded_state(records, after), value), name
    # a reader whose int string limit is Python's least (640 digits) reads them all the same
    # (docs/format.md: "whatever its process's sys.set_int_max_str_digits")
    low = read_states_elsewhere(root, list(at["ints"]), env={"PYTHONINTMAXSTRDIGITS": "640"})
    assert all(same(state, ACCEPTED["ints"]) for state in low.values())
    # a falsy state is a state: load_state hands it on (None alone means "no state")
    got: list[Any] = []

    class Gen:
        def load_state_dict(self, state: Any) -> None:
            got.append(state)

    for name in ("top_zero", "top_false", "top_empty_str", "top_empty_list", "empty_dict"):
        assert load_state(Gen(), fresh.generator_state(at[name][0])) is True, name
    assert [type(x) for x in got] == [int, bool, str, list, dict]


class _Bag(dict):
    pass


REFUSED: dict[str, Any] = {
    "tuple": {"t": (1, 2)},
    "tuple_in_list": [1, (2, 3)],
    "top_tuple": (1, 2),
    "nan": {"f": float("nan")},
    "inf": {"f": float("inf")},
    "neg_inf": [float("-inf")],
    "bytes": {"b": b"\x00\xff"},
    "bytearray": {"b": bytearray(b"ab")},
    "set": {"s": {1, 2}},
    "np_int64": {"n": np.int64(3)},
    "np_float32": {"f": np.float32(0.5)},
    "np_bool": {"b": np.bool_(True)},
    "np_array": {"a": np.arange(3)},
    "python_random_state": {"rng": random.Random(0).getstate()},
    "int_key": {1: "a"},
    "bool_key": {True: "a"},
    "none_key": {None: "a"},
    "tuple_key": {(1, 2): "a"},
    "lone_surrogate_key": {"k\ud800": 1},
    "lone_surrogate_value": {"k": "\udc80"},
    "int_past_the_bound": {"n": 10**4300},
    "deep_33": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    "over_1_mib": {"blob": "y" * (2**20)},
    "object": {"o": object()},
    "self_reference": None,  # built below: a list that holds itself
    "complex": {"c": 1j},
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_states_json_cannot_hold_are_refused_typed_and_change_nothing(tmp_path, name):
    """Each value the docs rule out (tuples, NaN/inf, bytes, sets, numpy scalars and arrays,
    random's state, non-str or surrogate keys, ints past 10**4300 - 1, 33 levels, over 1 MiB,
    objects, cycles) is an InvalidDataError naming generator_state, through ``append`` and
    through ``commit_staged`` (the parts then stay committable), and no file of the store
    changes."""
    value = REFUSED[name]
    if name == "self_reference":
        value = []
        value.append(value)
    root = tmp_path / "s"
    store = new_store(root)
    store.append([], meta={"step": 1}, outcomes=scored(1), generator_state={"ok": 1})
    before, head = files(root), store.head
    with pytest.raises(InvalidDataError) as caught:
        store.append([{"x": 9}], meta={"step": 2}, outcomes=scored(2), generator_state=value)
    assert "generator_state" in str(caught.value), str(caught.value)
    assert files(root) == before and store.refresh() == head
    part = store.stage([{"x": 9}])
    staged = files(root)
    with pytest.raises(InvalidDataError):
        store.commit_staged([part], meta={"step": 2}, outcomes=scored(2), generator_state=value)
    assert files(root) == staged and store.refresh() == head
    v = store.commit_staged([part], meta={"step": 2}, generator_state={"ok": 2})
    assert store.generator_state(v) == {"ok": 2} and store.snapshot(v).num_rows == 3
    # torch's RNG state: a uint8 tensor
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidDataError):
        store.append([], generator_state={"torch": torch.get_rng_state()})


def test_a_numpy_float64_in_a_state_is_refused_or_comes_back_a_numpy_float64(tmp_path):
    """DEFECT (fixed): a ``numpy.float64`` in a state (what ``np.mean``/``np.sum`` return; a
    generator keeping a running mean holds one) is accepted and silently comes back a Python
    ``float``,
    while ``numpy.int64``, ``numpy.float32`` and ``numpy.bool_`` are refused with "numpy and
    torch values: .item() or .tolist()". The docs accept plain types only and refuse tuples
    *because* they would come back changed (api.md "Outcomes and generator state"); a resumed
    generator then holds another type than the uninterrupted one (``x / 0.0`` is ``inf`` for
    one, ``ZeroDivisionError`` for the other). Expected: refused like the other numpy scalars
    (or documented, and returned as committed)."""
    root = tmp_path / "s"
    store = new_store(root)
    state = {"mean": np.float64(0.1) * 3}
    try:
        v = store.append([], generator_state=state)
    except InvalidDataError as exc:
        assert "numpy" in str(exc)
        return
    back = read_states_elsewhere(root, [v])[v]
    assert type(back["mean"]) is np.float64, f"committed numpy.float64, read back {back!r}"


# -- the state of a version, through resets, compaction and gc -----------------------------------


def _history(root: Path) -> tuple[Store, dict[int, Any], dict[str, int]]:
    """Rounds with and without state and outcomes, falsy states, a reset to a version whose
    lineage has no state, one to a stateful version, a compaction, past the outcome
    checkpoint at version 100. Returns the store, each version's state by the raw fold, and
    named versions."""
    store = Store.open(str(root), create=True)
    store.append([{"x": 0}, {"x": 1}])
    named: dict[str, int] = {}
    named["before_any_state"] = store.append([{"x": 2}], meta={"step": 1}, outcomes=scored(1))
    step = 1
    for k in range(1, 106):
        step += 1
        state = None
        if k % 7 == 0:
            state = {"k": k, "big": 2**64 + k, "z": -0.0, "nested": [{"k": [k]}]}
        elif k == 50:
            state = 0  # falsy, still a state
        elif k == 51:
            state = {}
        v = store.append(
            [{"x": k + 2}] if k % 3 else [],
            meta={"step": step},
            outcomes=scored(step) if k % 2 else None,
            generator_state=state,
        )
        named.setdefault(f"k{k}", v)
    named["reset_to_stateless"] = store.reset(named["before_any_state"])
    named["after_reset_stateless"] = store.append([{"x": -1}], meta={"step": 2})
    named["reset_to_stateful"] = store.reset(named["k50"])
    named["after_reset_stateful"] = store.append([], generator_state={"after": "reset"})
    named["plain_after"] = store.append([{"x": -2}])
    named["compacted"] = compact(store)
    named["head"] = store.append([{"x": -3}])
    records = raw_records(root)
    oracle = {v: folded_state(records, v) for v in records}
    return store, oracle, named


def test_the_state_of_every_version_is_the_raw_fold_after_reset_compaction_and_gc(tmp_path):
    """Every version's ``generator_state`` equals the newest state on its lineage folded by
    hand from the raw records (a reset brings its target's, none where the target's lineage
    has none, a compaction its source's), in this process and a fresh one, across the outcome
    checkpoint at version 100; after gc at grace 0 keeping tagged versions (the floor on a
    version that committed no state itself), each kept version still reads its state."""
    root = tmp_path / "s"
    store, oracle, named = _history(root)
    assert oracle[named["reset_to_stateless"]] is None
    assert oracle[named["after_reset_stateless"]] is None
    assert oracle[named["k50"]] == 0 and oracle[named["k51"]] == {}
    assert oracle[named["plain_after"]] == {"after": "reset"}
    assert oracle[named["compacted"]] == {"after": "reset"}
    for v, want in oracle.items():
        assert same(store.generator_state(v), want), v
    elsewhere = read_states_elsewhere(root, sorted(oracle))
    assert [v for v in oracle if not same(elsewhere[v], oracle[v])] == []

    # keep a stateless version inside the lineage of a state (the new floor), a version past
    # the outcome checkpoint, and the reset to a stateless target
    keep = [named["k9"], named["k104"], named["reset_to_stateless"]]
    assert "generator_state" not in raw_records(root)[named["k9"]]
    for i, v in enumerate(keep):
        store.tag(f"keep{i}", v)
    collect_garbage(store, older_than_s=0, grace_s=0, dry_run=False)
    left = raw_records(root)
    assert named["k9"] - 1 not in left  # gc collected below the floor
    fresh = Store.open(str(root))
    kept = [v for v in sorted(oracle) if v in left]
    assert set(keep) <= set(kept)
    for v in kept:
        assert same(fresh.generator_state(v), oracle[v]), v
    elsewhere = read_states_elsewhere(root, kept)
    assert [v for v in kept if not same(elsewhere[v], oracle[v])] == []


def test_a_writer_rebased_over_another_commits_its_own_state_on_top(tmp_path):
    """Two handles: the second commits on a head it has not seen (rebased over the first's
    round); each version's state is the raw fold (its own, or the lineage's newest), in both
    handles and a fresh process."""
    root = tmp_path / "s"
    one = new_store(root)
    two = Store.open(str(root))
    a = one.append([{"x": 2}], meta={"step": 1}, outcomes=scored(1), generator_state={"w": "one"})
    b = two.append([{"x": 3}], meta={"step": 2}, generator_state={"w": "two"})
    c = one.append([{"x": 4}], meta={"step": 3}, outcomes=scored(3))  # no state of its own
    assert (a, b, c) == (2, 3, 4)
    records = raw_records(root)
    want = {v: folded_state(records, v) for v in (a, b, c)}
    assert want == {a: {"w": "one"}, b: {"w": "two"}, c: {"w": "two"}}
    elsewhere = read_states_elsewhere(root, [a, b, c])
    for v, state in want.items():
        assert one.generator_state(v) == two.generator_state(v) == elsewhere[v] == state


BIG = 10**1000 + 7  # 1,001 digits: within the 4,300-digit bound every reader applies


@pytest.mark.parametrize("operation", ["rollback", "compact", "gc", "append"])
def test_a_process_with_a_lower_int_limit_can_carry_a_state_within_the_bound(tmp_path, operation):
    """DEFECT (fixed): a state holding an integer within the store's bound (1,001 digits; the
    bound is 4,300) committed by a default process makes every rollback, reset, compaction and
    gc by a
    process whose ``sys.set_int_max_str_digits`` is lower (640, Python's least; set with
    PYTHONINTMAXSTRDIGITS) fail with "InvalidDataError: a record cannot be written: Exceeds
    the limit (640 digits) ... keep integers within 4,300 digits": those operations copy the
    state into the record they write, encoded with ``json.dumps`` under the process's limit.
    That process reads the state fine (docs/format.md: readers convert every integer up to
    the bound "whatever its process's sys.set_int_max_str_digits (down to Python's least,
    640)"), but cannot roll the store back on resume, compact or collect it; SPEC §3.17 wants
    limits that do not depend on the writer. The same process appending such a state itself is
    refused too ("generator_state ... must be JSON-serializable: Exceeds the limit (640
    digits)"), although format.md says each integer a writer takes is judged "by magnitude
    with the bound", whatever its interpreter. Expected: the operation succeeds and the state
    of the new version is the carried (or committed) one."""
    root = tmp_path / "s"
    store = new_store(root)
    state = {"n": BIG, "neg": -BIG}
    v = store.append([{"x": 2}], meta={"step": 1}, outcomes=scored(1), generator_state=state)
    for step in (2, 3, 4):
        store.append([{"x": step + 1}], meta={"step": step}, outcomes=scored(step))
    code = textwrap.dedent(
        f"""
        import sys
        from dynstate import Store, collect_garbage, compact, rollback
        state = {{"n": 10**1000 + 7, "neg": -(10**1000 + 7)}}  # no literal: 640 digits at most
        store = Store.open(sys.argv[1])
        assert store.generator_state({v}) == state  # it reads it
        if {operation!r} == "rollback":
            new = rollback(store, version={v})
        elif {operation!r} == "compact":
            new = compact(store)
        elif {operation!r} == "append":
            new = store.append([], meta={{"step": 5}}, generator_state=state)
        else:
            collect_garbage(store, keep=2, grace_s=0, dry_run=False)
            new = store.head
        assert store.generator_state(new) == state
        print("ok")
        """
    )
    done = subprocess.run(
        [PY, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONINTMAXSTRDIGITS": "640"},
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    fresh = Store.open(str(root))
    assert fresh.generator_state() == state


# -- what a generator does to its state --------------------------------------------------------


def test_a_state_is_copied_at_commit_and_every_read_is_a_copy(tmp_path):
    """A generator that returns its internal dict and changes it after the commit, and a
    reader that changes what it read: neither changes the committed state (this handle's
    cache, another handle, the raw record)."""
    root = tmp_path / "s"
    store = new_store(root)

    class Gen:
        def __init__(self) -> None:
            self.state = {"seen": [1, 2], "n": {"a": 1}}

        def state_dict(self) -> dict[str, Any]:
            return self.state  # no copy

    gen = Gen()
    v = store.append([], meta={"step": 1}, outcomes=scored(1), generator_state=gen.state_dict())
    gen.state["seen"].append(3)
    gen.state["n"]["a"] = 99
    gen.state["new"] = True
    want = {"seen": [1, 2], "n": {"a": 1}}
    got = store.generator_state(v)
    assert got == want
    got["seen"].clear()
    got["n"]["a"] = -1
    assert store.generator_state(v) == want and store.generator_state() == want
    assert Store.open(str(root)).generator_state(v) == want
    assert raw_records(root)[v]["generator_state"] == want


# -- TRL: the real GRPOTrainer.train() -----------------------------------------------------------

TRL_GENERATOR = '''
import math


class Hostile:
    """verl's old interface (generate(dataset)) with a state of awkward plain values that
    changes every step; records every state load_state_dict gets."""

    name = "hostile-state"

    def __init__(self):
        self.count = 0
        self.loaded = []

    def state_dict(self):
        c = self.count
        return {
            "count": c,
            "big": 2**64 + c,
            "neg": -(2**70) - c,
            "z": -0.0,
            "k\\x00ey": ["a\\x00", {"deep": [[c]]}],
            "f": 0.1 * c,
            "e": {},
            "n": None,
            "u": "\\u2028\\U0001f600",
        }

    def load_state_dict(self, state):
        self.loaded.append(state)
        self.count = state["count"]

    def generate(self, dataset):
        self.count += 1
        return []


class RefusesItsState(Hostile):
    def load_state_dict(self, state):
        raise ValueError("this generator refuses the state it is given")


class StateDictRaises(Hostile):
    def state_dict(self):
        raise RuntimeError("state_dict failed")


class StateDictNotPlain(Hostile):
    def state_dict(self):
        return {"seen": {1, 2}}
'''

TRL_KILLED_RUN = """
import os, signal, sys
from pathlib import Path

sys.path[:0] = [sys.argv[3], sys.argv[4]]
import trl.trainer.grpo_trainer  # noqa: F401
import torch
from transformers import TrainerCallback
from test_trl import _example, _trainer
from dynstate import Store
from hostile_gen import Hostile

torch.set_num_threads(1)
example = _example()
store = Store.open(sys.argv[1], create=True)
store.append(example.first_tasks(0, count=16))


class KillAfterTheCommitOfStep4(TrainerCallback):
    # dynstate's own callback runs first: step 4's round is committed, its checkpoint not saved
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)


trainer = _trainer(
    example, store, Path(sys.argv[2]), generator=Hostile(),
    callbacks=[KillAfterTheCommitOfStep4()], config={"max_steps": 4},
)
trainer.train()
"""


@pytest.fixture(scope="module")
def trl_env(tmp_path_factory):
    """TRL and the example's tiny model (tests/test_trl.py's helpers), the hostile generator
    module, and a run SIGKILLed right after step 4's round was committed (checkpoint-2 is the
    newest): its store and output folder."""
    pytest.importorskip("trl")
    import trl.trainer.grpo_trainer  # noqa: F401  (imported in the main thread, as test_trl)

    base = tmp_path_factory.mktemp("trl_state")
    (base / "hostile_gen.py").write_text(TRL_GENERATOR)
    sys.path.insert(0, str(base))
    import hostile_gen  # noqa: F401
    from test_trl import _example

    script = base / "killed.py"
    script.write_text(TRL_KILLED_RUN)
    done = subprocess.run(
        [PY, str(script), str(base / "store"), str(base / "out"), str(base), str(HERE)],
        capture_output=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
    return _example(), base


def _trl_trainer(example: Any, store: Store, out: Path, generator: Any) -> Any:
    import torch
    from test_trl import _trainer

    torch.set_num_threads(1)
    return _trainer(example, store, out, generator=generator, config={"max_steps": 4})


def _step_versions(records: dict[int, dict[str, Any]], head: int) -> dict[int, int]:
    """Step -> the version of its round on ``head``'s lineage, from the raw records."""
    out: dict[int, int] = {}
    v: int | None = head
    while v is not None:
        record = records[v]
        step = record["meta"].get("step")
        if record["op"] == "append" and isinstance(step, int) and step not in out:
            out[step] = v
        if record["op"] == "reset":
            v = record["target"]
            continue
        v = record["parent"]
    return out


def test_trl_resume_after_a_kill_between_commit_and_checkpoint_loads_the_checkpoints_state(
    trl_env, tmp_path
):
    """A TRL run SIGKILLed right after step 4's round was committed, before checkpoint-4:
    resumed from checkpoint-2, the generator's ``load_state_dict`` is called once, with exactly
    the state of step 2's round as the raw record holds it (ints past 2**64, -0.0, NUL keys,
    types and all), not step 4's; the resumed run then commits, at steps 3 and 4, the states
    the killed run had committed there."""
    example, base = trl_env
    import hostile_gen

    root = tmp_path / "store"
    shutil.copytree(base / "store", root)
    shutil.copytree(base / "out", tmp_path / "out")
    killed = raw_records(root)
    killed_head = max(killed)
    before = _step_versions(killed, killed_head)
    assert {1, 2, 3, 4} <= set(before)
    assert not (tmp_path / "out" / "checkpoint-4").exists()
    want = folded_state(killed, before[2])
    assert want["count"] == 2 and folded_state(killed, before[4])["count"] == 4

    store = Store.open(str(root))
    gen = hostile_gen.Hostile()
    trainer = _trl_trainer(example, store, tmp_path / "out2", gen)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert len(gen.loaded) == 1, gen.loaded
    assert same(gen.loaded[0], want), (gen.loaded[0], want)
    after = raw_records(root)
    resumed = _step_versions(after, max(after))
    for step in (3, 4):
        assert resumed[step] > killed_head  # committed again by the resumed run
        assert same(folded_state(after, resumed[step]), folded_state(killed, before[step]))


def test_trl_resume_whose_generator_refuses_its_state_leaves_the_store_as_it_was(trl_env, tmp_path):
    """DEFECT (fixed): resuming through TRL with a generator whose ``load_state_dict`` raises (it
    refuses the state it is given) rolls the store back first: a reset commit is written
    (``_roll_back`` in dynstate/trl/trainer.py calls ``rollback`` and only then
    ``load_state``), so the abandoned rounds leave the head's lineage although the resume
    failed. verl's integration loads the state before its rollback commit "so a generator
    that refuses it leaves the store as it was" (dynstate/verl/dataset.py), and
    ``DynstateGRPOTrainer._resume`` promises "nothing in the store changes on a refusal".
    Expected: the generator's error surfaces and every file of the store is unchanged."""
    example, base = trl_env
    import hostile_gen

    root = tmp_path / "store"
    shutil.copytree(base / "store", root)
    shutil.copytree(base / "out", tmp_path / "out")
    before = files(root)
    store = Store.open(str(root))
    trainer = _trl_trainer(example, store, tmp_path / "out2", hostile_gen.RefusesItsState())
    with pytest.raises(ValueError, match="refuses the state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    changed = sorted(set(files(root).items()) ^ set(before.items()))
    assert files(root) == before, [name for name, _ in changed]


@pytest.mark.parametrize(
    ("cls", "error", "needle"),
    [
        ("StateDictRaises", RuntimeError, "state_dict failed"),
        ("StateDictNotPlain", InvalidDataError, "generator_state"),
    ],
)
def test_trl_generator_whose_state_dict_fails_commits_nothing(
    trl_env, tmp_path, cls, error, needle
):
    """A generator whose ``state_dict()`` raises, or returns what JSON cannot hold, under
    TRL's ``train()``: the error surfaces at step 1 (the latter a typed InvalidDataError naming
    generator_state), and step 1's round is not committed without its state: every file of
    the store is as it was before ``train()``."""
    example, _ = trl_env
    import hostile_gen

    root = tmp_path / "store"
    store = Store.open(str(root), create=True)
    store.append(example.first_tasks(0, count=16))
    before = files(root)
    gen = getattr(hostile_gen, cls)()
    trainer = _trl_trainer(example, store, tmp_path / "out", gen)
    with pytest.raises(error, match=needle):
        trainer.train()
    assert gen.count == 1  # it generated step 1's round
    assert files(root) == before


# -- verl: the real RayPPOTrainer.fit() on CPU ---------------------------------------------------

VERL_GENERATOR = '''
from dynstate.verl import DynstateGenerator


class Hostile(DynstateGenerator):
    """dynstate's interface with a state of awkward plain values that changes every step;
    appends every state load_state_dict gets to the file named by the datagen config's log."""

    name = "hostile-state"

    def __init__(self, config=None):
        super().__init__(config)
        self.count = 0

    def state_dict(self):
        c = self.count
        return {
            "count": c,
            "big": 2**64 + c,
            "neg": -(2**70) - c,
            "z": -0.0,
            "k\\x00ey": ["a\\x00", {"deep": [[c]]}],
            "f": 0.1 * c,
            "e": {},
        }

    def load_state_dict(self, state):
        import pickle

        with open(self.config["log"], "ab") as f:
            pickle.dump(state, f)
        self.count = state["count"]

    def generate(self, batch, step, dataset):
        self.count += 1
        return []


class Refuses(Hostile):
    def load_state_dict(self, state):
        raise ValueError("this generator refuses the state it is given")
'''


@pytest.fixture(scope="module")
def verl_world(tmp_path_factory):
    """tests/test_verl.py's zygote (one process that imported verl; each driver a fork of it)
    and its data files, without the S3 server the module's own fixture starts."""
    import test_verl

    root = tmp_path_factory.mktemp("verl_state")
    zygote = test_verl.Zygote(str(root))
    (root / "data").mkdir()
    spec = {
        "cmd": "data",
        "folder": str(root / "data"),
        "model": str(root / "model"),
        "output": str(root / "d.out"),
    }
    assert zygote.call(spec) == 0, (root / "d.out").read_text()[-3000:]
    (root / "hostile_verl_gen.py").write_text(VERL_GENERATOR)
    files_ = {
        "train": str(root / "data" / "train.parquet"),
        "val": str(root / "data" / "val.parquet"),
        "model": str(root / "model"),
    }
    yield zygote, root, files_
    zygote.close()


def _loaded(path: Path) -> list[Any]:
    out = []
    if path.exists():
        with open(path, "rb") as f:
            while True:
                try:
                    out.append(pickle.load(f))
                except EOFError:
                    return out
    return out


def test_verl_resume_after_a_kill_between_commit_and_checkpoint_loads_the_checkpoints_state(
    verl_world,
):
    """verl's ``fit()`` SIGKILLed right after step 4's round was committed (before
    ``global_step_4`` is saved), resumed from ``global_step_2`` in a new process: the
    generator's ``load_state_dict`` gets exactly the state of step 2's round in the raw record
    (types, -0.0 and all); then a resume whose generator refuses its state stops with the
    generator's error and leaves every file of the store as it was (the state is loaded before
    the rollback commit)."""
    import test_verl

    zygote, root, _ = verl_world
    log = root / "loaded.pkl"
    datagen = {"path": str(root / "hostile_verl_gen.py"), "name": "Hostile", "log": str(log)}
    spec = test_verl.new_run(
        verl_world, "killed", datagen=datagen, steps=4, batch_size=6, test_freq=100
    )
    assert zygote.call({**spec, "kill": [4, "committed"]}) == -9, test_verl.output(spec)
    store_root = Path(spec["store"])
    assert not os.path.exists(os.path.join(spec["ckpt"], "global_step_4"))
    killed = raw_records(store_root)
    before = _step_versions(killed, max(killed))
    assert {1, 2, 3, 4} <= set(before)
    want = folded_state(killed, before[2])
    assert want["count"] == 2

    # a copy of the killed run, resumed with a generator that refuses its state
    refused = test_verl.new_run(
        verl_world,
        "refused",
        datagen={**datagen, "name": "Refuses"},
        steps=4,
        batch_size=6,
        test_freq=100,
    )
    shutil.copytree(spec["store"], refused["store"])
    shutil.copytree(spec["ckpt"], refused["ckpt"])
    unchanged = files(Path(refused["store"]))
    assert zygote.call(refused) == 1, test_verl.output(refused)
    assert "refuses the state it is given" in test_verl.output(refused, tail=10**7)
    assert files(Path(refused["store"])) == unchanged

    assert zygote.call(spec) == 0, test_verl.output(spec)
    loaded = _loaded(log)
    assert len(loaded) == 1 and same(loaded[0], want), (loaded, want)
    after = raw_records(store_root)
    resumed = _step_versions(after, max(after))
    for step in (3, 4):
        assert resumed[step] > max(killed)
        assert same(folded_state(after, resumed[step]), folded_state(killed, before[step]))
    assert same(dynstate.Store.open(spec["store"]).generator_state(resumed[2]), want)
