"""The Search-R1 example's reward: exact match of the final `<answer>...</answer>` against the label.

    --custom-rm-path examples.search_r1.reward.exact_match

Only the text after the last `</information>` counts (the model's own final turn), so an answer that appears in a
retrieved document never scores by itself. Comparison is after normalisation (case, punctuation, articles, spaces),
as in Search-R1's EM score.
"""

from __future__ import annotations

import re
import string

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def final_answer(response: str) -> str | None:
    """The last <answer> of the model's final turn, or None."""
    final_turn = response.rsplit("</information>", 1)[-1]
    answers = _ANSWER.findall(final_turn)
    return answers[-1] if answers else None


def answer_reward(response: str, label: str) -> float:
    answer = final_answer(response)
    return 1.0 if answer is not None and normalize(answer) == normalize(str(label)) else 0.0


async def exact_match(args, sample) -> float:
    return answer_reward(sample.response, sample.label)
