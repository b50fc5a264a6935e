"""Two tasks for a run that trains one LoRA adapter per task: the quickstart's single-digit addition (`add`) and
single-digit subtraction with a non-negative answer (`sub`, a different answer rule on the same kind of question),
a BPE tokenizer trained on both and a tiny random-init Qwen3. Nothing is downloaded.

Files written under `out_dir`: model/, sft.jsonl (chat messages of both tasks, for the full warm start), train.jsonl
(prompts, labels and each row's adapter in the `task` field, the tasks alternating), eval_add.jsonl and eval_sub.jsonl (held-out problems,
with their `task`).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from examples.quickstart.task import INSTRUCTION, MODEL_SHAPE, write_jsonl
from slime.utils.tiny_model import build_tiny_model

TASKS = ("add", "sub")


def problems(task: str) -> list[tuple[str, str]]:
    if task == "add":
        return [(f"What is {a} + {b}? {INSTRUCTION}", str(a + b)) for a in range(10) for b in range(10)]
    return [(f"What is {a} - {b}? {INSTRUCTION}", str(a - b)) for a in range(10) for b in range(a + 1)]


def build_two_tasks(out_dir: str | Path, seed: int = 0, num_eval: int = 15) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sft, train_by_task, evals = [], {}, {}
    for task in TASKS:
        items = problems(task)
        rng.shuffle(items)
        held_out, kept = items[:num_eval], items[num_eval:]
        sft += [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"\\boxed{{{a}}}"}]}
                for q, a in kept]
        train_by_task[task] = [{"prompt": [{"role": "user", "content": q}], "label": a, "task": task} for q, a in kept]
        evals[task] = [{"prompt": [{"role": "user", "content": q}], "label": a, "task": task} for q, a in held_out]
    rng.shuffle(sft)
    # the tasks alternate (while both last), so every rollout of an unshuffled run holds both adapters' prompts
    train = [row for pair in itertools.zip_longest(*train_by_task.values()) for row in pair if row is not None]
    paths = {"sft": out_dir / "sft.jsonl", "train": out_dir / "train.jsonl",
             **{f"eval_{task}": out_dir / f"eval_{task}.jsonl" for task in TASKS}}
    write_jsonl(paths["sft"], sft)
    write_jsonl(paths["train"], train)
    for task in TASKS:
        write_jsonl(paths[f"eval_{task}"], evals[task])
    corpus = [q + " \\boxed{" + a + "}" for task in TASKS for q, a in problems(task)] + ["user assistant system -"]
    paths["model"] = build_tiny_model(out_dir / "model", arch="qwen3", corpus=corpus, vocab_size=300, seed=seed,
                                      **MODEL_SHAPE)
    return paths


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the two-task model and data (see the module docstring).")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    print(json.dumps({name: str(path) for name, path in build_two_tasks(opts.out_dir, seed=opts.seed).items()}))
