"""Math answer rewards: `math`, `deepscaler` (1 / 0) and `dapo` ({"score": +-1, "acc", "pred"})."""

from __future__ import annotations

import re

from slime.rollout.rm_hub.answer_parsing import (
    label_answer,
    last_boxed_content,
    normalize_final_answer,
    text_after_thinking,
)
from slime.rollout.rm_hub.math_verify_pool import math_equal_in_pool

DAPO_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


async def answers_equal(pred: str, label) -> bool:
    """Exact match after normalisation, else math-verify equivalence (in the worker pool)."""
    gold = label_answer(label)
    normalized_pred = normalize_final_answer(pred)
    if normalized_pred and normalized_pred == normalize_final_answer(gold):
        return True
    return await math_equal_in_pool(pred, gold)


async def math_reward(response: str, label) -> float:
    """1.0 if the last `\\boxed{}` answer of the response equals the label (string or math-verify), else 0.0."""
    pred = last_boxed_content(response)
    if pred is None or not pred.strip():
        return 0.0
    return 1.0 if await answers_equal(pred, label) else 0.0


async def deepscaler_reward(response: str, label) -> float:
    """`math_reward` on the text after the reasoning (`</think>` or `###Response`); 0.0 when the reasoning never
    ended."""
    answer_part = text_after_thinking(response)
    if answer_part is None:
        return 0.0
    return await math_reward(answer_part, label)


def dapo_reward(response: str, label) -> dict:
    """DAPO's minerva-style check on the last 300 characters: the last "Answer: X" line (or, failing that, the last
    `\\boxed{}`), normalised, must equal the normalised label. Score +1 / -1."""
    tail = response[-DAPO_TAIL_CHARS:]
    matches = _ANSWER_LINE.findall(tail)
    raw = matches[-1] if matches else last_boxed_content(tail)
    pred = normalize_final_answer(raw) if raw is not None else "[INVALID]"
    correct = raw is not None and pred == normalize_final_answer(label_answer(label))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
