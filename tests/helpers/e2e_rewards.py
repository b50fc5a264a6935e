"""Reward functions for the end-to-end tests (`--custom-rm-path tests.helpers.e2e_rewards.NAME`)."""

import zlib


async def response_hash_parity(args, sample) -> float:
    """0 or 1 from a hash of the response text: a random tiny model's groups get rewards that vary, which
    dynamic sampling (check_reward_nonzero_std) needs to accept them."""
    return float(zlib.crc32(sample.response.encode()) % 2)


async def sample_index_parity(args, sample) -> float:
    """0 or 1 by the sample's index: the samples of a group have consecutive indices, so every group of two or more
    gets both rewards and every step has a non-zero advantage (tests that need training to move the weights)."""
    return float(sample.index % 2)


def never_returns(args, sample) -> float:
    """A plain (non-async) reward that hangs forever: --reward-timeout must bound it, and its thread must not keep
    the rollout process alive after the run (tests/e2e/test_process_lifetime.py)."""
    import time

    while True:
        time.sleep(3600)
