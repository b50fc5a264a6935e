"""SQuAD token-level F1 (`--rm-type f1`; slime's `slime.rollout.rm_hub.f1`: `f1_score` returns slime's
(f1, precision, recall) tuple)."""

from __future__ import annotations

import re
import string
from collections import Counter

from slime.rollout.rm_hub.answer_parsing import strip_thinking

_EXACT_ONLY = ("yes", "no", "noanswer")
ZERO_METRIC = (0, 0, 0)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """(F1, precision, recall) of the normalised token bags; yes / no / noanswer must match exactly (else zeros),
    as must a None prediction."""
    if prediction is None:
        return ZERO_METRIC
    pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
    if (pred in _EXACT_ONLY or gold in _EXACT_ONLY) and pred != gold:
        return ZERO_METRIC
    pred_tokens, gold_tokens = pred.split(), gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return ZERO_METRIC
    precision, recall = num_same / len(pred_tokens), num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward(response: str, label) -> float:
    """Best F1 of the answer (text after any reasoning) against the label, or against each label of a list."""
    golds = label if isinstance(label, (list, tuple)) else [label]
    answer = strip_thinking(response)
    return max((f1_score(answer, str(gold))[0] for gold in golds), default=0.0)
