"""slime's DeepScaleR rule reward (`slime.rollout.rm_hub.deepscaler`): 1 if the boxed answer after the reasoning
(`</think>` or `###Response`) equals the label under `math_utils`' MATH normalisation or sympy, else 0.

The same semantics as slime's, for plugins that import it; `--rm-type deepscaler` uses
`slime.rollout.rm_hub.math_rewards.deepscaler_reward` (math-verify).
"""

from __future__ import annotations

from slime.rollout.rm_hub.math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0  # the reasoning never ended
    answer = extract_answer(solution)
    if answer is None or label == "":
        return 0
    if not isinstance(label, (str, float, int)):
        raise ValueError(f"deepscaler reward: the label must be a string or a number, got {type(label).__name__}")
    truth = str(label)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return 0
    return 1 if grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth) else 0
