"""The OpenAI-agent example's reward: 1 when the agent's final answer names exactly one weather condition and it
is the row's label, else 0 (no answer, a hedge like "sunny or rainy", a wrong condition).

`--custom-rm-path examples.openai_agent.reward.final_answer_reward`. The final answer is the content of the
agent's last assistant message, which generate.py puts in `metadata["final_answer"]`; a Sample's own response text
is not used, because a sibling Sample (a forked history) holds only part of the episode.
"""

from __future__ import annotations

import re

from examples.openai_agent.task import CONDITIONS

_CONDITION = re.compile(r"\b(" + "|".join(CONDITIONS) + r")\b", re.IGNORECASE)


def conditions_named(text: str | None) -> set[str]:
    return {match.lower() for match in _CONDITION.findall(text or "")}


def score(final_answer: str | None, label: str) -> float:
    return float(conditions_named(final_answer) == {label})


async def final_answer_reward(args, sample) -> float:
    return score(sample.metadata.get("final_answer"), sample.label)
