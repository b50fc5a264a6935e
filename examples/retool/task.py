"""The ReTool example's task, built locally: `a * b + c` with a two-digit `a` and one-digit `b` and `c` (hard for a
tiny model in its head, one line of Python with a tool), SFT conversations, GRPO prompts, a BPE tokenizer trained on
all of it, and a tiny Qwen3 model. Nothing is downloaded.

A share `tool_share` of the SFT conversations call the `python` tool and box what it printed; the others answer at
once with a guess ("The answer is \\boxed{...}." with a random number: the tiny model cannot multiply in its head).
After that warm start the model calls the tool in about that share of its answers: RL has something to learn (call
it every time), and the reward before RL is well below what it can reach. The guess is worded unlike the answer after
the tool (`\\boxed{...}` alone), so the first turn's first token is the choice between the two. The problems are few
(`num_problems`, 8 by default), and the GRPO prompts are the SFT's: a 4-layer model does not learn to copy digits
(from the question into the code, from the tool's output into the box) in a few minutes of SFT, but it learns each
problem's call and answer.

Files written under `out_dir`: sft.jsonl (chat messages, with a role "tool" turn where the tool is used, and the
tool schema, for `slime.rollout.sft_rollout`), train.jsonl (prompt + label) and model/ (HF checkpoint).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from examples.retool.python_tool import python
from slime.rollout.tools import tool_schema
from slime.utils.tiny_model import build_tiny_model

MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
INSTRUCTION = "Use the python tool, then put the answer in \\boxed{}."


def head_answer(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def problem(a: int, b: int, c: int) -> tuple[str, str, str]:
    """(question, code, answer)."""
    return f"What is {a} * {b} + {c}? {INSTRUCTION}", f"print({a} * {b} + {c})", str(a * b + c)


def tool_call_text(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_task(out_dir: str | Path, seed: int = 0, num_problems: int = 8, tool_share: float = 0.5,
               num_sft_rows: int = 256) -> dict[str, Path]:
    if not 0 < tool_share <= 1:
        raise ValueError(f"tool_share must be in (0, 1], got {tool_share}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    problems = [problem(rng.randint(10, 99), rng.randint(2, 9), rng.randint(1, 9)) for _ in range(num_problems)]
    schema = tool_schema(python)  # what the GRPO run's --tool-functions-path renders into the prompt

    def conversation(q: str, code: str, answer: str) -> list[dict]:
        if rng.random() >= tool_share:
            guess = str(rng.randint(10 * 2 + 1, 99 * 9 + 9))
            return [{"role": "user", "content": q}, {"role": "assistant", "content": head_answer(guess)}]
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": tool_call_text(code)},
                {"role": "tool", "content": answer + "\n"},  # what print() writes
                {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]

    sft_rows = [{"messages": conversation(*rng.choice(problems)), "tools": [schema]} for _ in range(num_sft_rows)]
    train_rows = [{"prompt": [{"role": "user", "content": q}], "label": answer} for q, _, answer in problems * 4]
    paths = {name: out_dir / f"{name}.jsonl" for name in ("sft", "train")}
    write_jsonl(paths["sft"], sft_rows)
    write_jsonl(paths["train"], train_rows)

    # Tags, the tool-call JSON and the tool block are in the tokenizer's corpus, so a call costs few tokens.
    tool_block = json.dumps(schema) + ' Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    corpus = [f"{q} {tool_call_text(code)} {answer} \\boxed{{{answer}}} {head_answer(answer)}"
              for q, code, answer in problems] + \
        ["user assistant system tool # Tools", tool_block] * 20
    paths["model"] = build_tiny_model(out_dir / "model", arch="qwen3", corpus=corpus, vocab_size=1000, seed=seed,
                                      **MODEL_SHAPE)
    return paths
