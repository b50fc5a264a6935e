"""Splitting a model's thinking from its answer in sampled text (the adapters' `reasoning_parser`).

`qwen3` and `deepseek_r1` (alias `deepseek-r1`) models think inside `<think>...</think>`; their chat templates may
open the block in the generation prompt, so a sampled text can start inside it. Pure string functions. Not the tool
call parsers (`slime.utils.tool_parsers`).
"""

from __future__ import annotations


def _think_tags(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a text that thinks inside <think>...</think>."""
    opened, closed = text.find("<think>"), text.find("</think>")
    if closed != -1 and (opened == -1 or opened < closed):
        start = opened + len("<think>") if opened != -1 else 0
        return text[start:closed].strip(), text[closed + len("</think>"):].lstrip()
    if opened != -1:  # cut off while thinking (max_tokens)
        return text[opened + len("<think>"):].strip(), text[:opened].strip()
    return "", text


REASONING_PARSERS = {"qwen3": _think_tags, "deepseek_r1": _think_tags, "deepseek-r1": _think_tags}


def get_reasoning_parser(name: str | None):
    """The parser named `name` (None: no reasoning parser, the whole text is the answer)."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {name!r}: use one of {sorted(REASONING_PARSERS)} or None")
    return REASONING_PARSERS[name]
