"""The rule-based reward for the arithmetic tasks, in verl's ``custom_reward_function`` form.

verl's ``default_compute_score`` knows only its own data sources (gsm8k, MATH, …); tasks with
``data_source: arith`` are scored here: 1.0 when the last number in the response is the ground
truth, else 0.0. Configured in arith.yaml as ``reward.custom_reward_function``.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d+")


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> float:
    numbers = NUMBER.findall(solution_str[-300:])
    return 1.0 if numbers and numbers[-1] == str(ground_truth).strip() else 0.0
