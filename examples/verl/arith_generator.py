"""A rule-based generator for verl + dynstate: variations of the arithmetic tasks the policy
failed in the last step.

Rows look like verl's GSM8K/arith preprocessing: ``prompt`` (chat messages), ``data_source``,
``ability``, ``reward_model: {style, ground_truth}``, ``extra_info: {split, index}``. A task
is "failed" when its mean token-level score in the batch is below ``threshold``; each failed
``a + b`` task yields ``variations`` new tasks with shifted operands, each recording its source
row in ``_dynstate_source``. Deterministic: same batch and step, same rows.

Config (``data.datagen``)::

    path: examples/verl/arith_generator.py
    name: ArithVariations
    variations: 1        # new tasks per failed task
    max_new: 8           # cap per step
    threshold: 0.5
"""

from __future__ import annotations

import re
from typing import Any

from dynstate.verl import DynstateGenerator

TASK = re.compile(r"What is (\d+) \+ (\d+)\?")


def make_task(a: int, b: int, index: int, split: str = "train") -> dict[str, Any]:
    return {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


class ArithVariations(DynstateGenerator):
    name = "arith-variations"

    def __init__(self, config: Any = None):
        super().__init__(config)
        get = config.get if config is not None else (lambda _k, d=None: d)
        self.variations = int(get("variations", 1))
        self.max_new = int(get("max_new", 8))
        self.threshold = float(get("threshold", 0.5))

    def generate(self, batch: Any, step: int, dataset: Any) -> list[dict[str, Any]]:
        scores = batch.batch["token_level_scores"].sum(dim=-1).tolist()
        prompts = batch.non_tensor_batch["raw_prompt"]
        rows = batch.non_tensor_batch["dynstate_row"]
        out: list[dict[str, Any]] = []
        for score, messages, source in zip(scores, prompts, rows, strict=True):
            found = TASK.search(messages[-1]["content"]) if score < self.threshold else None
            if found is None:
                continue
            a, b = int(found.group(1)), int(found.group(2))
            for k in range(1, self.variations + 1):
                if len(out) >= self.max_new:
                    return out
                task = make_task(a + k * step, b + k, index=100_000 * step + len(out))
                task["_dynstate_source"] = [int(source)]
                out.append(task)
        return out
