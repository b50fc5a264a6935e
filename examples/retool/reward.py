"""The ReTool example's reward: the last `\\boxed{}` of the model's final turn, graded by slime's math reward
(`slime.rollout.rm_hub.math_rewards.math_reward`: exact match after normalisation, else math-verify).

    --custom-rm-path examples.retool.reward.boxed_answer

Only the final assistant turn counts: a `\\boxed{}` that the code printed (inside a tool message) never scores.
"""

from __future__ import annotations

from slime.rollout.rm_hub.math_rewards import math_reward

ASSISTANT_HEADER = "<|im_start|>assistant\n"


def final_turn(response: str) -> str:
    """The text after the last assistant header (the chat template writes one after every tool message), or the
    whole response when no tool was called."""
    return response.rsplit(ASSISTANT_HEADER, 1)[-1]


async def boxed_answer(args, sample) -> float:
    return await math_reward(final_turn(sample.response), sample.label)
