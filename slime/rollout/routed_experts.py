"""The MoE routing a rollout engine returns with `return_routed_experts` (SGLang's form, spec section 12):
`meta_info["routed_experts"]`, base64 of int32 [len(tokens) - 1 - routed_experts_start_len, num_hidden_layers,
top_k], one row per position that went through a forward (prompt and generated tokens but the last), an entry for
EVERY decoder layer (the dense layers' entries zeros: SGLang's layout, so real SGLang and the built-in engine are
interchangeable). Decoded into `Sample.rollout_routed_experts` ([len(tokens) - 1, num_hidden_layers, top_k] int32
numpy), which --use-rollout-routing-replay (R3) replays in the trainer, reading the MoE layers' entries by layer
index. A continuation asks only for the rows after those the sample already holds.

Not the request itself (sglang_rollout.sample_continuation) and not the replay (slime/backends/routing_replay.py).
"""

from __future__ import annotations

import base64

import numpy as np

from slime.utils.moe_config import routing_shape
from slime.utils.types import Sample


def routed_experts_request(args, sample: Sample) -> dict:
    """The /generate fields that ask for the routing of `sample`'s next turn: rows from the first position the
    sample holds no routing for (0 for a fresh sample; a continuation keeps its earlier rows)."""
    if not args.use_rollout_routing_replay:
        return {}
    held = 0 if sample.rollout_routed_experts is None else len(sample.rollout_routed_experts)
    return {"return_routed_experts": True, "routed_experts_start_len": min(held, len(sample.tokens))}


def store_routed_experts(args, sample: Sample, meta_info: dict, start_len: int) -> None:
    """Append the rows of a /generate answer to `sample.rollout_routed_experts`, after the response tokens were
    appended: rows from `start_len` on (what the engine echoes in meta_info, else what was sent: sglang-router
    0.3.2 drops the request's routed_experts_start_len and the built-in engine then answers from 0). A missing or
    mis-sized record is a ValueError naming the sample."""
    if not args.use_rollout_routing_replay:
        return
    name = f"sample {sample.index} (group {sample.group_index})"
    payload = meta_info.get("routed_experts")
    if payload is None:
        raise ValueError(f"{name}: --use-rollout-routing-replay but the engine returned no routed_experts (start "
                         "SGLang with --enable-return-routed-experts; the built-in engine gets it automatically)")
    num_layers, top_k = routing_shape(args.hf_checkpoint)
    rows = np.frombuffer(base64.b64decode(payload), dtype="<i4")
    expected_rows = len(sample.tokens) - 1 - start_len
    if rows.size != expected_rows * num_layers * top_k:
        raise ValueError(f"{name}: routed_experts holds {rows.size} ids, expected {expected_rows} positions x "
                         f"{num_layers} decoder layers x top-{top_k} (SGLang's layout; len(tokens) - 1 - "
                         f"routed_experts_start_len = "
                         f"{len(sample.tokens)} - 1 - {start_len})")
    rows = rows.reshape(expected_rows, num_layers, top_k).astype(np.int32)
    held = sample.rollout_routed_experts[:start_len] if sample.rollout_routed_experts is not None else rows[:0]
    sample.rollout_routed_experts = np.concatenate([held, rows])
