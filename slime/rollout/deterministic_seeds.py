"""Sampling seeds of `--deterministic-mode`: every /generate request carries a `sampling_seed` that is a pure function
of (--rollout-seed, rollout id, sample index) and of how many tokens the request continues from, and the engine's
noise is keyed by (that seed, position) (engine/sampler.py), so a token's draw never depends on a batch slot, on
timing or on which engine serves it. With SGLang's parallel sampling (`n`), copy j draws with the seed + j."""

from __future__ import annotations

import hashlib

SEED_BITS = 31  # leaves room for the engine's `seed + j` of n copies


def request_seed(rollout_seed: int, rollout_id: int | None, sample_index: int, num_context_tokens: int = 0) -> int:
    key = f"{rollout_seed}/{rollout_id}/{sample_index}/{num_context_tokens}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % (1 << SEED_BITS)


def with_sample_seed(args, sampling_params: dict, rollout_id: int | None, sample_index: int) -> dict:
    """`sampling_params` with this sample's seed under --deterministic-mode (unchanged otherwise)."""
    if not getattr(args, "deterministic_mode", False):  # slime's plugins may pass args without the flag
        return sampling_params
    return {**sampling_params, "sampling_seed": request_seed(args.rollout_seed, rollout_id, sample_index)}


def continuation_seed(args, sampling_params: dict, num_context_tokens: int) -> dict:
    """A request continuing `num_context_tokens` tokens (a later turn, a resumed partial rollout): its seed mixes the
    context length in, so its positions draw fresh noise rather than the first request's again."""
    seed = sampling_params.get("sampling_seed")
    if not getattr(args, "deterministic_mode", False) or seed is None:
        return sampling_params
    return {**sampling_params, "sampling_seed": request_seed(seed, None, 0, num_context_tokens)}
