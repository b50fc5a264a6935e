"""The OpenAI-agent example's task, built locally: "What is the weather in <city>?", where today's weather is drawn
at random per row and only the agent's `get_weather` tool knows it (without the tool the best policy is right one
time in len(CONDITIONS)). A BPE tokenizer trained on the conversations and a tiny Qwen3 model; nothing is downloaded.

Files written under `out_dir`:
- sft.jsonl: conversations in the chat template's shape plus the `tools` column, for `slime.rollout.sft_rollout`.
  A share `tool_share` of them use the tool (an assistant message with `tool_calls`, the role "tool" result, the
  final answer); the others answer at once with a guess ("Probably rainy.", a random condition). After that warm start the model calls
  the tool in about that share of its episodes, right there, and guesses in the others, right one time in four: RL
  has something to learn (call the tool every time), and the reward before RL is well below what it can reach;
- train.jsonl: `prompt` (the user message), `label` (the city's weather) and `metadata.conditions` (the episode's
  world: every city's weather, read by the tool in generate.py);
- model/: the HF checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from examples.openai_agent.agent import GET_WEATHER
from slime.utils.tiny_model import build_tiny_model

CITIES = ("Paris", "Tokyo", "Lima", "Oslo")
CONDITIONS = ("sunny", "rainy", "cloudy", "snowy")
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


def question(city: str) -> str:
    return f"What is the weather in {city}?"


def final_answer(condition: str) -> str:
    return f"It is {condition}."


def tool_call(city: str) -> dict:
    return {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def conversation(city: str, condition: str) -> list[dict]:
    """The episode the SFT warm start teaches: call the tool with the asked city, answer with what it returned."""
    return [{"role": "user", "content": question(city)},
            {"role": "assistant", "content": "", "tool_calls": [tool_call(city)]},
            {"role": "tool", "tool_call_id": "call_0", "content": condition},
            {"role": "assistant", "content": final_answer(condition)}]


def random_world(rng: random.Random) -> dict[str, str]:
    return {city: rng.choice(CONDITIONS) for city in CITIES}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def guessed_answer(condition: str) -> str:
    return f"Probably {condition}."


def guess(city: str, rng: random.Random) -> list[dict]:
    """An episode without the tool: the answer is a guess. Worded unlike `final_answer`, so that the first turn's
    first token is the choice between calling the tool and guessing, and "It" follows the tool's result only."""
    return [{"role": "user", "content": question(city)},
            {"role": "assistant", "content": guessed_answer(rng.choice(CONDITIONS))}]


def build_data(out_dir: str | Path, seed: int = 0, num_rows: int = 512, tool_share: float = 1.0) -> dict[str, Path]:
    """sft.jsonl and train.jsonl (module docstring), `num_rows` each; the data a real checkpoint trains on too."""
    if not 0 < tool_share <= 1:
        raise ValueError(f"tool_share must be in (0, 1], got {tool_share}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sft_rows, train_rows = [], []
    for _ in range(num_rows):
        city, world = rng.choice(CITIES), random_world(rng)
        messages = conversation(city, world[city]) if rng.random() < tool_share else guess(city, rng)
        sft_rows.append({"messages": messages, "tools": [GET_WEATHER]})
        city, world = rng.choice(CITIES), random_world(rng)
        train_rows.append({"prompt": [{"role": "user", "content": question(city)}], "label": world[city],
                           "metadata": {"conditions": world}})
    paths = {name: out_dir / f"{name}.jsonl" for name in ("sft", "train")}
    write_jsonl(paths["sft"], sft_rows)
    write_jsonl(paths["train"], train_rows)
    return paths


def build_task(out_dir: str | Path, seed: int = 0, num_rows: int = 512, tool_share: float = 0.5) -> dict[str, Path]:
    """build_data plus the tiny model (a tokenizer trained on the task's text): {"sft", "train", "model"} paths."""
    paths = build_data(out_dir, seed, num_rows, tool_share)
    # The tool block, the call JSON and the answers are in the tokenizer's corpus, so a turn costs few tokens.
    tool_block = json.dumps(GET_WEATHER) + ' Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    calls = [f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps({"city": c})}}}</tool_call>'
             for c in CITIES]
    words = ["system", "user", "assistant", "tool", *CONDITIONS]  # as they start a line of the rendered template
    corpus = ([question(c) for c in CITIES] + calls + [final_answer(c) for c in CONDITIONS] +
              [guessed_answer(c) for c in CONDITIONS] + words) * 20 + \
        ["# Tools", tool_block] * 20
    paths["model"] = build_tiny_model(Path(out_dir) / "model", arch="qwen3", corpus=corpus, vocab_size=1000, seed=seed,
                                      **MODEL_SHAPE)
    return paths
