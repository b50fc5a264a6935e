"""Pulling the final answer out of a model response: `\\boxed{}` extraction, reasoning stripping, normalisation.

Pure string functions (no sympy, no I/O); the equivalence check that needs sympy lives in `math_verify_pool`.
"""

from __future__ import annotations

import re

THINK_END_MARKERS = ("</think>", "###Response")


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) in `text`, braces balanced; else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    name_end = len("\\boxed") if rest.startswith("\\boxed") else len("\\fbox")
    after = rest[name_end:]
    if after.startswith(" "):  # "\boxed 5" (no braces): the token up to the next space or "$"
        words = after[1:].split("$")[0].split()  # none in "\boxed $x$": nothing boxed
        return words[0] if words else None
    if not after.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(after):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return after[1:i]
    return None  # unbalanced: the response was cut off inside the box


def text_after_thinking(response: str) -> str | None:
    """The part of `response` after the last reasoning-end marker (`</think>` or `###Response`), else None."""
    for marker in THINK_END_MARKERS:
        if marker in response:
            return response.rsplit(marker, 1)[1]
    return None


def strip_thinking(response: str) -> str:
    """`text_after_thinking(response)` when there is a marker, else the whole response."""
    after = text_after_thinking(response)
    return response if after is None else after


def label_answer(label) -> str:
    """A gold label as an answer string: a boxed label is unboxed, numbers become their str."""
    text = str(label).strip()
    boxed = last_boxed_content(text)
    return boxed if boxed is not None else text


_UNIT_WORDS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "points", "feet", "minutes",
    "digits", "cents", "degrees", "cm", "pounds", "meters", "meals", "edges", "students", "multiples",
)
_LATEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "^\\circ", "^{\\circ}",
                "\\%", "%", "\\$", "$", "\\dots", "\\ldots", "{,}")


def normalize_final_answer(answer: str) -> str:
    """Minerva-style canonical form of a final answer, for exact string comparison.

    Keeps the right-hand side of an equation, drops units, spacing and sizing commands, unwraps `\\text{}` /
    `\\textbf{}` / `\\mathrm{}` / `\\boxed{}`, writes `\\frac12` as `\\frac{1}{2}` and `\\sqrt2` as `\\sqrt{2}`, and
    removes thousands separators from integers.
    """
    text = answer.strip().split("=")[-1]
    for noise in _LATEX_NOISE:
        text = text.replace(noise, "")
    for pattern in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\mathrm\{(.*?)\}", r"\\mbox\{(.*?)\}"):
        text = re.sub(pattern, r"\1", text)
    boxed = last_boxed_content(text)
    if boxed is not None:
        text = boxed
    for word in _UNIT_WORDS:
        text = re.sub(rf"(?<![a-zA-Z\\]){word}(?![a-zA-Z])", "", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\frac([^{\s])([^{\s])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]*)\}([^{\s])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt([^{\s])", r"\\sqrt{\1}", text)
    text = text.replace(" ", "").rstrip(".")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()
