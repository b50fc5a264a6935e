"""Multiple-choice letter reward (`--rm-type gpqa`): extract the chosen letter (A-J), compare with the label."""

from __future__ import annotations

import re

from slime.rollout.rm_hub.answer_parsing import last_boxed_content, strip_thinking

LETTERS = "ABCDEFGHIJ"


def extract_choice_letter(text: str, valid_letters: str = LETTERS) -> str | None:
    """The letter the response commits to, trying in order: `\\boxed{X}`, "answer is (X)" / "Answer: X", the last
    "(X)", a final line that is just "X" or "X.". None if nothing matches."""
    letters = f"[{valid_letters}]"
    boxed = last_boxed_content(text)
    if boxed is not None:
        match = re.fullmatch(rf"\s*(?:\\text\{{)?\(?({letters})\)?(?:\}})?\s*", boxed)
        if match:
            return match.group(1)
    patterns = (
        rf"(?i:answer)(?:\s+is)?\s*[:：]?\s*\**\(?({letters})\)?(?![A-Za-z])",
        rf"\(({letters})\)",
        rf"(?m)^\s*\**({letters})\**[.)]?\s*$",
    )
    for pattern in patterns:
        found = re.findall(pattern, text)
        if found:
            return found[-1]
    return None


def label_letter(label, choices: list | None = None) -> str | None:
    """The gold letter from a label that is a letter ("C", "(C)"), a 0-based index, or the text of one choice."""
    if isinstance(label, int) and not isinstance(label, bool):
        return LETTERS[label] if 0 <= label < len(LETTERS) else None
    text = str(label).strip()
    match = re.fullmatch(rf"\(?([{LETTERS}])\)?", text)
    if match:
        return match.group(1)
    if choices:
        for i, choice in enumerate(choices):
            if str(choice).strip() == text:
                return LETTERS[i]
    return None


def gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    """1.0 if the extracted letter equals the gold letter, else 0.0. `metadata["choices"]` (optional) bounds the
    valid letters and lets the label be the text of the correct choice."""
    choices = (metadata or {}).get("choices")
    valid = LETTERS[: len(choices)] if choices else LETTERS
    gold = label_letter(label, choices)
    pred = extract_choice_letter(strip_thinking(response), valid)
    return 1.0 if gold is not None and pred == gold else 0.0
