"""A task a tiny model can only solve with a tool, for the end-to-end agent test (tests.helpers.agent_tool_task.*).

Every prompt asks the same question; each row's answer ("yes" or "no") is drawn at random when the data is built
and only the `lookup` tool can tell it (it reads the conversation's Sample: the row's label). The model calls the
tool by writing `@.` (parsed by `parse_call`, a parser given by dotted path); the tool's answer is written into the
turn as `= \\boxed{yes}` and the model then ends its answer. Without the tool the best policy is right half the
time. The SFT warm start uses the tool in half of its rows and answers "yes" without it in the other half, so after
SFT the model calls the tool about half the time and RL has something to learn: calling it is the only way to be
always right.

The tool gives the boxed answer itself, rather than the model copying it from the tool's text: with a copy, GRPO
learned "after the tool, answer no" in two of nine runs, both in CI (a "yes" row is answered right without the tool
too, so only "no" rows reward calling it, and the 4-layer model's copying gave way): the call rate rose slowly or
fell back.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from slime.utils.tiny_model import build_tiny_model
from slime.utils.tool_parsers import ParsedTurn, ToolCall

MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
ANSWERS = ("yes", "no")
QUESTION = "is it open? look up with @."
RESPONSE_TEMPLATE = "= {result}\n"  # --tool-response-template
SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "Whether it is open.",
                                           "parameters": {"type": "object", "properties": {}}}}


def lookup(sample) -> str:
    """Whether it is open: this conversation's own answer, boxed."""
    return boxed(sample.label)


def boxed(answer: str) -> str:
    return f"\\boxed{{{answer}}}"


lookup.tool_schema = SCHEMA


def parse_call(text: str, tools: list[dict]) -> ParsedTurn:
    if "@" not in text:
        return ParsedTurn(text, [])
    return ParsedTurn(text.replace("@", ""), [ToolCall("lookup", {}, "@")])


parse_call.inline_response = True
parse_call.stop_strings = ["."]


async def reward(args, sample) -> float:
    """1 when the last \\boxed{} of the response is the row's answer."""
    answers = re.findall(r"\\boxed\{(\w+)\}", sample.response)
    return float(bool(answers) and answers[-1] == sample.label)


def build_task(out_dir: str | Path, seed: int = 0, num_rows: int = 512) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sft_rows = []
    for _ in range(num_rows):
        value = rng.choice(ANSWERS)
        with_tool = rng.random() < 0.5
        answer = f"@.{RESPONSE_TEMPLATE.format(result=boxed(value))}" if with_tool else boxed("yes")
        sft_rows.append({"messages": [{"role": "user", "content": QUESTION},
                                      {"role": "assistant", "content": answer}]})  # inline: no tool block
    prompts = [{"prompt": [{"role": "user", "content": QUESTION}], "label": rng.choice(ANSWERS)}
               for _ in range(num_rows)]
    paths = {name: out_dir / f"{name}.jsonl" for name in ("sft", "train")}
    for name, rows in (("sft", sft_rows), ("train", prompts)):
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    corpus = [f"{QUESTION} = {boxed(a)}" for a in ANSWERS] * 20 + ["user assistant system"]
    paths["model"] = build_tiny_model(out_dir / "model", arch="qwen3", corpus=corpus, vocab_size=1000, seed=seed,
                                      **MODEL_SHAPE)
    return paths
