"""The vl_shapes reward (`--custom-rm-path examples.vl_shapes.reward.reward`): 1.0 when the response's first word
is the label ("3", "blue"), else 0.0."""

from __future__ import annotations


def first_word(response: str) -> str:
    words = response.replace("<|im_end|>", " ").strip().split()
    return words[0].strip(".,!").lower() if words else ""


async def reward(args, sample) -> float:
    return float(first_word(sample.response) == str(sample.label).lower())
