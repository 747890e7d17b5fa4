"""A stateful generator for verl + dynstate: variations of the tasks solved least often so far.

"The model proposes new tasks based on which tasks currently succeed": after every step this
generator reads the per-row statistics of the store (``dataset.outcome_stats()``: every
earlier step's outcomes, which dynstate records with each round) and adds the step's own
scores from the batch; it then picks the ``max_new`` hardest rows — lowest pass rate, then
the rows it has picked least often, then the most attempts — among those not solved every
time, and writes one variation of each (the source row with other operands: same data
source, same prompt layout), with its source row in ``_dynstate_source``.

Its state (how many tasks it made, how often it picked each row) changes what it writes, so
it must survive a crash: ``state_dict()`` / ``load_state_dict()`` are committed with each
round and loaded from the checkpointed version on resume. Deterministic: the same statistics,
batch, step and state give the same rows.

Config (``data.datagen``)::

    path: examples/verl/hardest_first.py
    name: HardestFirst
    max_new: 4           # new tasks per step
    success_above: 0.5   # a response with a higher score solved its task
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from dynstate.verl import DynstateGenerator

TASK = re.compile(r"What is (\d+) \+ (\d+)( ?)\?")


def variation(source: dict[str, Any], shift_a: int, shift_b: int, index: int) -> dict | None:
    """``source`` (a store row) asking ``a + shift_a`` plus ``b + shift_b`` instead; None if
    its last message is not an ``a + b`` task."""
    messages = [dict(m) for m in source["prompt"]]
    found = TASK.search(messages[-1]["content"])
    if found is None:
        return None
    a, b = int(found.group(1)) + shift_a, int(found.group(2)) + shift_b
    text = messages[-1]["content"]
    asked = f"What is {a} + {b}{found.group(3)}?"
    messages[-1]["content"] = text[: found.start()] + asked + text[found.end() :]
    row = {k: v for k, v in source.items() if k != "_dynstate_source"}
    row["prompt"] = messages
    row["reward_model"] = {**(source.get("reward_model") or {}), "ground_truth": str(a + b)}
    row["extra_info"] = {**(source.get("extra_info") or {}), "index": index}
    return row


def hardest_rows(
    attempts: np.ndarray, successes: np.ndarray, picked: dict[int, int], n: int
) -> list[int]:
    """The ``n`` trained rows with the lowest pass rate (solved less than every time), ties
    broken by fewest earlier picks, then most attempts, then row number."""
    trained = np.flatnonzero((attempts > 0) & (successes < attempts))
    rate = successes[trained] / attempts[trained]
    times = np.array([picked.get(int(r), 0) for r in trained], dtype=np.int64)
    order = np.lexsort((trained, -attempts[trained], times, rate))
    return [int(trained[i]) for i in order[:n]]


class HardestFirst(DynstateGenerator):
    name = "hardest-first"

    def __init__(self, config: Any = None):
        super().__init__(config)
        get = config.get if config is not None else (lambda _k, d=None: d)
        self.max_new = int(get("max_new", 4))
        self.success_above = float(get("success_above", 0.5))
        self.made = 0
        self.picked: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"made": self.made, "picked": {str(r): n for r, n in sorted(self.picked.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.made = int(state["made"])
        self.picked = {int(r): int(n) for r, n in state["picked"].items()}

    def generate(self, batch: Any, step: int, dataset: Any) -> list[dict[str, Any]]:
        stats = dataset.outcome_stats(success_above=self.success_above)
        attempts = np.asarray(stats.column("attempts").to_pylist(), dtype=np.int64)
        successes = np.asarray(stats.column("successes").to_pylist(), dtype=np.int64)
        # this step's scores are not in the store yet (they are committed with this round)
        scores = batch.batch["token_level_scores"].sum(dim=-1).tolist()
        for row, score in zip(batch.non_tensor_batch["dynstate_row"], scores, strict=True):
            attempts[int(row)] += 1
            successes[int(row)] += score > self.success_above
        out: list[dict[str, Any]] = []
        for row in hardest_rows(attempts, successes, self.picked, self.max_new):
            task = variation(dataset.dataframe[row], self.made + 1, step, 200_000 + self.made)
            if task is None:
                continue
            self.made += 1
            self.picked[row] = self.picked.get(row, 0) + 1
            task["_dynstate_source"] = [row]
            out.append(task)
        return out
