"""Files both CPU drivers of verl need (tests/verl_cpu.py for the legacy trainer,
tests/verl_v1_standins.py for the V1 trainer): a word-level tokenizer/model folder and
arithmetic data as verl's preprocessing writes it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def make_model_dir(folder: str, words: list[str], chat_template: str, pre_tokenizer: str) -> str:
    """A word-level tokenizer (``pre_tokenizer``: a class name in ``tokenizers.pre_tokenizers``)
    and a tiny model config, saved like a HF model folder (no weights: nothing here loads a
    model). verl reads it with ``from_pretrained``, offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = getattr(pre_tokenizers, pre_tokenizer)()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    hf.chat_template = chat_template
    hf.save_pretrained(folder)
    LlamaConfig(
        vocab_size=len(words),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    return folder


def write_data(
    folder: str, n_train: int, n_val: int, make_task: Callable[..., dict[str, Any]]
) -> tuple[str, str]:
    """Arithmetic tasks (rows from ``make_task(a, b, index=, split=)``) written to
    train/val parquet files; every 7th training prompt is overlong, so verl's filter drops it
    on import."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    rows = []
    for i in range(n_train):
        a, b = (int(x) for x in rng.integers(1, 60, size=2))
        task = make_task(a, b, index=i)
        if i % 7 == 3:
            task["prompt"][0]["content"] += " and" * 40
        rows.append(task)
    val = [make_task(i, i + 1, index=i, split="test") for i in range(n_val)]
    train_path = os.path.join(folder, "train.parquet")
    val_path = os.path.join(folder, "val.parquet")
    pd.DataFrame(rows).to_parquet(train_path)
    pd.DataFrame(val).to_parquet(val_path)
    return train_path, val_path
