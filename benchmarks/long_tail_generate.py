"""A `--custom-generate-function-path` for benchmarks: each sample's response length is drawn from a Pareto
distribution (alpha 1.1, a few samples 30x the median), seeded by the sample's index so every mode of
bench_fully_async.py generates the same lengths; EOS is ignored so the length is exactly the drawn one.
Not for training: the lengths ignore what the model writes."""

from __future__ import annotations

import math
import random

from slime.rollout.sglang_rollout import generate as default_generate

PARETO_ALPHA = 1.1
MEDIAN_SHARE = 1 / 32  # the median response is this share of --rollout-max-response-len


def drawn_length(index: int, max_new_tokens: int) -> int:
    scale = max(1, round(max_new_tokens * MEDIAN_SHARE / 2 ** (1 / PARETO_ALPHA)))
    return min(max_new_tokens, math.ceil(scale * random.Random(index).paretovariate(PARETO_ALPHA)))


async def generate(args, sample, sampling_params):
    if "long_tail_length" not in sample.metadata:  # fixed once: a continuation after a weight push keeps it
        sample.metadata["long_tail_length"] = drawn_length(sample.index, sampling_params["max_new_tokens"])
    return await default_generate(args, sample, {**sampling_params, "ignore_eos": True,
                                                 "max_new_tokens": sample.metadata["long_tail_length"]})
