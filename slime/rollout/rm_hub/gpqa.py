"""Multiple-choice letter reward (`--rm-type gpqa`; slime's `slime.rollout.rm_hub.gpqa`, same scores).

`compute_gpqa_reward(response, label, metadata)`: the gold letter comes from `metadata["correct_letter"]`, a letter
label, a 0-based index label, or a label whose text is one of `metadata["choices"]` (list or dict); the response's
letter from "answer / option / choice (is|:) X", "X is (the) correct", "final answer (is|:) X", else its last
standalone valid capital. 1.0 on a letter match; with no letter to compare, 1.0 if the gold answer's text appears in
the response. Reasoning before `</think>` is ignored.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])
_LETTER_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])",
)


def _strip_chain_of_thought(text: str) -> str:
    if not text:
        return ""
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _normalize_text(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _extract_letter_from_response(response: str, valid_letters: Iterable[str]) -> str | None:
    """The option letter the response picks, or None."""
    if not response:
        return None
    text = _strip_chain_of_thought(response)
    valid = {letter.upper() for letter in valid_letters}
    for pattern in _LETTER_PATTERNS:
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def _choices(metadata: dict) -> list | None:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return list(choices) if choices is not None else None


def compute_gpqa_reward(response: str | None, label, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    metadata = metadata or {}
    choices = _choices(metadata)
    if metadata.get("valid_letters"):
        valid_letters = [str(letter).upper() for letter in metadata["valid_letters"]]
    elif choices:
        valid_letters = list(string.ascii_uppercase[:len(choices)])
    else:
        valid_letters = DEFAULT_VALID_LETTERS
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None

    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in valid_letters and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and 0 <= int(label) < len(valid_letters):
        correct = valid_letters[int(label)]
    if not correct and choices and label_text:  # the label is the text of one choice
        for index, choice in enumerate(choices):
            if _normalize_text(str(choice)) == _normalize_text(label_text):
                correct = valid_letters[index]
                metadata.setdefault("correct_answer", choice)
                break

    extracted = _extract_letter_from_response(response, valid_letters)
    if extracted and correct:
        return 1.0 if extracted == correct else 0.0

    targets = []
    if correct and choices and correct in valid_letters and valid_letters.index(correct) < len(choices):
        targets.append(str(choices[valid_letters.index(correct)]))
    targets += [str(metadata[key]) for key in ("correct_answer", "answer_text") if metadata.get(key)]
    if label_text:
        targets.append(label_text)
    answer = _normalize_text(_strip_chain_of_thought(response))
    if any(_normalize_text(t) and _normalize_text(t) in answer for t in targets):
        return 1.0
    if extracted and not correct and label_text:
        return 1.0 if extracted == label_text.strip().upper() else 0.0
    return 0.0
