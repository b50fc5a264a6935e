"""The engine benchmark's workloads (the engine-speed issue's W1-W4, the RL-speed issue's W5) as prompts and
per-request output lengths: W1 / W4 fixed lengths at T=1 (W4 on the 8B shape), W2 nano-vllm's random lengths at
T=0.6, W3 GRPO groups of identical prompts, W5 W1's lengths at batch 512 on a 135M-parameter shape (where the host's
work per step matters most). `--preset tiny` gives small variants of each for the CPU."""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.engine_checkpoints import (
    QWEN3_06B_SHAPE,
    QWEN3_8B_SHAPE,
    SMOLLM_135M_SHAPE,
    TINY_LARGE_SHAPE,
    TINY_SHAPE,
    make_prompts,
)

# (W2 sequences, W2 min length, W2 max length, W3 prompts, W3 prompt length, W3 max output)
WORKLOAD_SIZES = {"tiny": (16, 8, 64, 4, 64, 32), "qwen3-0.6b": (256, 100, 1024, 64, 512, 1024)}
W3_SAMPLES_PER_PROMPT = 8


@dataclass
class Workload:
    name: str
    title: str
    shape: dict  # the model's config.json fields
    prompts: list[list[int]]
    max_new_tokens: list[int]
    temperature: float
    ignore_eos: bool
    samples_per_prompt: int = 1  # consecutive prompts share their token ids (the n samples of a GRPO group)


def make_workload(name: str, args) -> Workload:
    tiny = args.preset == "tiny"
    small_shape = TINY_SHAPE if tiny else QWEN3_06B_SHAPE
    if name == "w5":
        shape = TINY_SHAPE if tiny else SMOLLM_135M_SHAPE
        num_prompts = 2 * args.num_prompts
        prompts = make_prompts(num_prompts, args.input_len, shape["vocab_size"], args.seed + 1)
        title = f"W5 (135M shape): {num_prompts} x {args.input_len} in, {args.output_len} out, T=1"
        return Workload(name, title, shape, prompts, [args.output_len] * num_prompts, 1.0, True)
    if name in ("w1", "w4"):
        shape = small_shape if name == "w1" else (TINY_LARGE_SHAPE if tiny else QWEN3_8B_SHAPE)
        prompts = make_prompts(args.num_prompts, args.input_len, shape["vocab_size"], args.seed)
        title = f"{'W1' if name == 'w1' else 'W4 (8B shape)'}: {args.num_prompts} x {args.input_len} in, " \
                f"{args.output_len} out, T=1"
        return Workload(name, title, shape, prompts, [args.output_len] * args.num_prompts, 1.0, True)
    num_seqs, min_len, max_len, num_groups, prompt_len, max_output = WORKLOAD_SIZES[args.preset]
    if name == "w2":
        # nano-vllm's bench.py, draw for draw: all prompts first, then all output lengths.
        rng = random.Random(args.seed)
        max_token_id = min(10000, small_shape["vocab_size"] - 1)
        prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_len))]
                   for _ in range(num_seqs)]
        max_new_tokens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
        title = f"W2 (nano-vllm): {num_seqs} seqs, in/out uniform [{min_len}, {max_len}], T=0.6"
        return Workload(name, title, small_shape, prompts, max_new_tokens, 0.6, True)
    groups = make_prompts(num_groups, prompt_len, small_shape["vocab_size"], args.seed)
    prompts = [prompt for prompt in groups for _ in range(W3_SAMPLES_PER_PROMPT)]
    title = f"W3 (GRPO): {num_groups} prompts x {W3_SAMPLES_PER_PROMPT} samples, {prompt_len} in, <= {max_output} out"
    return Workload(name, title, small_shape, prompts, [max_output] * len(prompts), 1.0, False,
                    samples_per_prompt=W3_SAMPLES_PER_PROMPT)
