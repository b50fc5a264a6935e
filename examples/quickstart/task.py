"""The quickstart's task, built locally: single-digit addition with `\\boxed{}` answers, a BPE tokenizer trained
on it, and a tiny random-init Qwen3 model. Nothing is downloaded.

Files written under `out_dir`: model/ (HF checkpoint), sft.jsonl (chat messages with the answer), train.jsonl and
eval.jsonl (prompts + labels; eval holds problems that never appear in train).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from slime.utils.tiny_model import build_tiny_model

INSTRUCTION = "Put the answer in \\boxed{}."
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


def problem(a: int, b: int) -> tuple[str, str]:
    return f"What is {a} + {b}? {INSTRUCTION}", str(a + b)


def all_problems() -> list[tuple[str, str]]:
    """All 100 single-digit sums. A tiny model generalises addition to unseen pairs within a few hundred steps,
    so held-out accuracy measures learning, not memorisation."""
    return [problem(a, b) for a in range(10) for b in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_task(out_dir: str | Path, seed: int = 0, num_eval: int = 20) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    eval_problems, train_problems = problems[:num_eval], problems[num_eval:]

    sft_rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"\\boxed{{{a}}}"}]}
                for q, a in train_problems]
    prompt_rows = lambda items: [{"prompt": [{"role": "user", "content": q}], "label": a} for q, a in items]
    paths = {name: out_dir / f"{name}.jsonl" for name in ("sft", "train", "eval")}
    write_jsonl(paths["sft"], sft_rows)
    write_jsonl(paths["train"], prompt_rows(train_problems))
    write_jsonl(paths["eval"], prompt_rows(eval_problems))

    corpus = [q + " \\boxed{" + a + "}" for q, a in problems] + ["user assistant system -"]
    shape = dict(MODEL_SHAPE)  # an "arch" entry (benchmarks: "qwen3_moe") picks another architecture
    paths["model"] = build_tiny_model(out_dir / "model", arch=shape.pop("arch", "qwen3"), corpus=corpus,
                                      vocab_size=300, seed=seed, **shape)
    return paths


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the quickstart's model and data (see the module docstring).")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    print(json.dumps({name: str(path) for name, path in build_task(opts.out_dir, seed=opts.seed).items()}))
