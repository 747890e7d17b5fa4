"""tools/trl_curriculum.py in a tiny mode (4 steps, 1 seed, two arms): its JSON checked against
what it read and what it trained. The per-step mean reward against a plain mean of the trace's
rewards for that step (the step's last line); the held-out accuracy against a greedy decode by
hand (one prompt at a time, argmax of the logits, no ``generate``) of the final checkpoint; the
arms' stores against the arms' settings (the static store keeps its 48 first tasks, the
generator's grows) and the held-out tasks never written to any store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import pyarrow as pa

import dynstate

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "trl_curriculum.py"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def tool_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_curriculum", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trace_means(path: Path) -> dict[int, float]:
    last: dict[int, list[float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        last[record["step"]] = record["rewards"]
    return {step: sum(r) / len(r) for step, r in last.items()}


def greedy_by_hand(model: Any, tokenizer: Any, prompt: str) -> str:
    import torch

    ids = tokenizer(text=[prompt])["input_ids"][0]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(2):
            logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1]
            new.append(int(logits.argmax()))
            if new[-1] == tokenizer.eos_token_id:
                break
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.slow  # two training subprocesses of ~15 s each, most of it imports
def test_tiny_run_matches_traces_and_checkpoints(tmp_path: Path) -> None:
    work, out_json, png = tmp_path / "work", tmp_path / "c.json", tmp_path / "c.png"
    subprocess.run(
        [sys.executable, str(TOOL), "--steps", "4", "--seeds", "1", "--eval-every", "2",
         "--arms", "static,generator+select", "--work", str(work),
         "--json", str(out_json), "--png", str(png)],
        check=True, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    result = json.loads(out_json.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(result["arms"]) == ["static", "generator+select"]
    tool = tool_module()
    ex = tool.example()
    hold = {tuple(int(x) for x in p.split("+")) for p in result["settings"]["hold_out"].split(",")}
    assert len(hold) == 5

    from transformers import LlamaForCausalLM

    tokenizer = ex.build_tokenizer()
    for arm, data in result["arms"].items():
        (run,) = data["runs"]
        trace = Path(run["trace"])
        means = trace_means(trace)
        assert sorted(means) == [1, 2, 3, 4]
        assert run["reward"] == pytest.approx([means[s] for s in (1, 2, 3, 4)], abs=1e-12)
        summary = data["summary"]
        assert summary["reward_first_fifth"]["mean"] == pytest.approx(means[1], abs=1e-12)
        assert summary["reward_last_fifth"]["mean"] == pytest.approx(means[4], abs=1e-12)

        # held-out accuracy of the final checkpoint, decoded by hand
        assert [p["step"] for p in run["eval"]] == [0, 2, 4]
        model = LlamaForCausalLM.from_pretrained(trace.parent / "out" / "checkpoint-4").eval()
        answers = {
            f"{a}+{b}": greedy_by_hand(model, tokenizer, f"{a}+{b}=")
            for a in range(ex.OPERAND + 1)
            for b in range(ex.OPERAND + 1)
        }
        final = run["eval"][-1]
        assert final["answers"] == answers
        right = {k: v.strip() == str(sum(map(int, k.split("+")))) for k, v in answers.items()}
        held = [right[f"{a}+{b}"] for a, b in sorted(hold)]
        train = [v for k, v in right.items() if tuple(map(int, k.split("+"))) not in hold]
        assert final["held_out"] == sum(held) / len(held)
        assert final["train_pairs"] == sum(train) / len(train) and len(train) == 20
        assert summary["held_out_final"]["mean"] == final["held_out"]

        # the arm's store: held-out tasks never written; the generator on or off
        store = dynstate.Store.open(str(trace.parent / "store"))
        snap = store.snapshot()
        table = pa.concat_tables(snap.read_shard(i) for i in range(len(snap.shards)))
        written = set(zip(table["a"].to_pylist(), table["b"].to_pylist(), strict=True))
        assert not written & hold
        trained = {r for line in trace.read_text().splitlines() for r in json.loads(line)["rows"]}
        if arm == "static":
            assert table.num_rows == 48 and max(trained) < 48
        else:
            assert table.num_rows > 48
