"""slime's DAPO math grader (`slime.rollout.rm_hub.math_dapo_utils`): the Minerva answer check DAPO trains with.

`compute_score(solution, ground_truth)` looks at the last 300 characters, takes the last "Answer: X" line (or,
with `strict_box_verify`, the last `\\boxed{}` of the last 100 characters), normalises it (`normalize_final_answer`:
units, `\\text{}`, shorthand TeX, thousands separators) and compares it with the integer ground truth:
{"score": 1.0 | -1.0, "acc": bool, "pred": str}. The same semantics as slime's, for plugins that import it;
`--rm-type dapo` uses `slime.rollout.rm_hub.math_rewards.dapo_reward`.
"""

from __future__ import annotations

import re

SOLUTION_TAIL_CHARS = 300  # the longest MATH-500 answer has 159 characters
STRICT_BOX_TAIL_CHARS = 100

# Minerva's normalisation tables: (before, after) replacements, then expressions removed outright.
SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots", "<|im_end|>",
    "<|endoftext|>",
]
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string` (braces balanced), or None (none, or cut off inside it)."""
    start = string.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[start:i + 1]
    return None


def remove_boxed(s: str) -> str:
    """The content of `\\boxed{content}`; AssertionError if `s` is not exactly that."""
    left = "\\boxed{"
    assert s[:len(left)] == left and s[-1] == "}", f"box error: {s}"
    return s[len(left):-1]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's canonical form of a final answer (the right-hand side of an equation)."""
    text = str(final_answer).split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)
    for command in ("text", "textbf", "overline"):
        text = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)  # \fracab -> \frac{a}{b}
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)  # \sqrta -> \sqrt{a}
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = ANSWER_PATTERN) -> tuple[bool, str]:
    """(the last "Answer:" line equals the integer ground truth, the normalised prediction)."""
    matches = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    gt = normalize_final_answer(remove_boxed(last_boxed_only_string(gt)) if gt_need_extract else gt)
    gt = str(int(float(gt)))  # DAPO's answers are integers
    return pred == gt, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None
                          ) -> tuple[int, str | None]:
    """(1 if the last `\\boxed{}` near the end equals `gt` verbatim else -1, its content)."""
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4
        pred = pred[pause_tokens_index[-1] - STRICT_BOX_TAIL_CHARS:]
    else:
        pred = pred[-STRICT_BOX_TAIL_CHARS:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """{"score": 1.0 if correct else -1.0, "acc": correct, "pred": the normalised prediction}."""
    correct, pred = verify(solution_str[-SOLUTION_TAIL_CHARS:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
