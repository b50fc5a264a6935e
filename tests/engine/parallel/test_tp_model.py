"""A model sharded over two real gloo ranks computes what the one-device model computes: through a prefill and
several decode steps of a mixed greedy / sampled batch, rank 0's tokens equal a TP=1 runner's, its log-probs within
1e-5 and its logits within 3e-5 (fp32 sums in another order), for a dense Qwen3 with GQA (one and two K/V heads per
rank), one with fewer K/V heads than ranks (replicated), a Llama with q/k/v and o_proj biases and an odd, untied
vocabulary (padding; the row-parallel bias added once), Qwen3-MoE at TP=2 and at TP=2 x EP=2, Qwen2-MoE (shared
expert) at TP=2 x EP=2, GLM-4 (fused gate_up_proj in the checkpoint) at TP=2 and GLM-4.5 (sigmoid router) at TP=2 x
EP=2, with the routed experts every rank records equal to TP=1's. Every rank holds the same full
logits and samples what rank 0 samples.

One spawn of two ranks runs every case; the TP=1 reference runs here."""

from pathlib import Path

import pytest
import torch

from slime.engine.models import load_model_config
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.tp_ranks import (
    assert_ranks_equal_one_rank,
    build_runner,
    randomize_biases_and_norms,
    rank_parallel,
    run_steps,
    spawn_ranks,
)

NUM_DECODE_STEPS = 4
WORLD_SIZE = 2
# case -> (checkpoint, ep_size)
CASES = {
    "qwen3_gqa": ("qwen3_gqa", 1),
    "qwen3_two_kv_heads_per_rank": ("qwen3_8q_4kv", 1),
    "qwen3_one_kv_head": ("qwen3_one_kv_head", 1),
    "llama_bias_odd_vocab": ("llama_bias_odd_vocab", 1),
    "qwen3_moe_tp2": ("qwen3_moe", 1),
    "qwen3_moe_tp2_ep2": ("qwen3_moe", 2),
    "qwen2_moe_tp2_ep2": ("qwen2_moe", 2),
    "glm4_tp2": ("glm4", 1),
    "glm4_moe_tp2_ep2": ("glm4_moe", 2),
}
CHECKPOINTS = {
    "qwen3_gqa": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2),
    "qwen3_8q_4kv": dict(arch="qwen3", num_attention_heads=8, num_key_value_heads=4),  # 2 K/V heads per rank
    "qwen3_one_kv_head": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=1),
    # embedding_size 515: odd, so the vocabulary is padded to 516 over two ranks
    "llama_bias_odd_vocab": dict(arch="llama", attention_bias=True, tie_word_embeddings=False, embedding_size=515),
    "qwen3_moe": dict(arch="qwen3_moe"),
    # layer 1 dense: dense and sparse feed-forwards in one stack
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1]),
    "glm4": dict(arch="glm4"),  # the checkpoint's own fused gate_up_proj, split by gate and up rows
    "glm4_moe": dict(arch="glm4_moe"),  # sigmoid router + correction bias replicated, ungated shared expert
}


def _worker(rank, world_size, paths, out_dir):
    for case, (checkpoint, ep_size) in CASES.items():
        parallel = rank_parallel(rank, world_size, ep_size)
        is_moe = checkpoint.endswith("moe")
        runner = build_runner(paths[checkpoint], parallel, enable_return_routed_experts=is_moe)
        torch.save(run_steps(runner, NUM_DECODE_STEPS, parallel), Path(out_dir) / f"{case}.rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_model")
    paths = {name: str(build_tiny_model(root / name, initializer_range=0.3, **overrides))
             for name, overrides in CHECKPOINTS.items()}
    for path in paths.values():
        randomize_biases_and_norms(path)
    out_dir = root / "out"
    out_dir.mkdir()
    spawn_ranks(_worker, WORLD_SIZE, paths, str(out_dir))
    return paths, out_dir


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(results, case):
    paths, out_dir = results
    checkpoint, _ = CASES[case]
    reference = run_steps(build_runner(paths[checkpoint], enable_return_routed_experts=checkpoint.endswith("moe")),
                          NUM_DECODE_STEPS)
    ranks = [torch.load(out_dir / f"{case}.rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    assert_ranks_equal_one_rank(ranks, reference)
    if "routed_experts" in reference:  # both EP blocks are routed to, so each rank masks out the other's experts
        routed = {int(e) for block in reference["routed_experts"] for e in block.reshape(-1)}
        num_experts = load_model_config(paths[checkpoint]).num_experts
        assert min(routed) < num_experts // 2 <= max(routed)
    if checkpoint == "llama_bias_odd_vocab":
        assert load_model_config(paths[checkpoint]).vocab_size % WORLD_SIZE == 1  # padded over the ranks
