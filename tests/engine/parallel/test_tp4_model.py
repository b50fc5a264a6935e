"""Four real gloo ranks against one: a dense Qwen3 of 8 q / 2 K/V heads at TP=4 (each K/V head on two ranks, one q
head pair per rank, the vocabulary padded over four) and Qwen2-MoE at TP=4 x EP=2 (two expert blocks, each cut over
two ranks; the shared expert over all four): rank 0's logits, tokens and log-probs, and every rank's routed experts,
equal the one-rank runner's through a prefill and decode steps (the TP=2 cases: test_tp_model.py)."""

from pathlib import Path

import pytest
import torch

from slime.utils.tiny_model import build_tiny_model
from tests.helpers.tp_ranks import (
    assert_ranks_equal_one_rank,
    build_runner,
    randomize_biases_and_norms,
    rank_parallel,
    run_steps,
    spawn_ranks,
)

NUM_DECODE_STEPS = 3
WORLD_SIZE = 4
CASES = {"qwen3_kv2_tp4": ("qwen3_kv2", 1), "qwen2_moe_tp4_ep2": ("qwen2_moe", 2)}
CHECKPOINTS = {
    "qwen3_kv2": dict(arch="qwen3", num_attention_heads=8, num_key_value_heads=2, embedding_size=515),
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1]),
}


def _worker(rank, world_size, paths, out_dir):
    for case, (checkpoint, ep_size) in CASES.items():
        parallel = rank_parallel(rank, world_size, ep_size)
        runner = build_runner(paths[checkpoint], parallel, enable_return_routed_experts=checkpoint.endswith("moe"))
        torch.save(run_steps(runner, NUM_DECODE_STEPS, parallel), Path(out_dir) / f"{case}.rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp4_model")
    paths = {name: str(build_tiny_model(root / name, initializer_range=0.3, **overrides))
             for name, overrides in CHECKPOINTS.items()}
    for path in paths.values():
        randomize_biases_and_norms(path)
    out_dir = root / "out"
    out_dir.mkdir()
    spawn_ranks(_worker, WORLD_SIZE, paths, str(out_dir))
    return paths, out_dir


@pytest.mark.parametrize("case", list(CASES))
def test_tp4_equals_tp1(results, case):
    paths, out_dir = results
    checkpoint, _ = CASES[case]
    reference = run_steps(build_runner(paths[checkpoint], enable_return_routed_experts=checkpoint.endswith("moe")),
                          NUM_DECODE_STEPS)
    ranks = [torch.load(out_dir / f"{case}.rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    assert_ranks_equal_one_rank(ranks, reference)
