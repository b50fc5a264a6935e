"""The sharded model on two GPUs over NCCL (fp32): rank 0's logits, tokens, log-probs and routed experts equal a
one-GPU runner's through a prefill and decode steps, with the GPU paths on: the fused Triton q/k norm + rotary + K/V
store and Triton paged attention on each rank's local heads (one K/V head replicated on both ranks in one case), the
grouped_mm experts of each rank's EP block, and decode steps replayed from CUDA graphs that hold the NCCL
all-reduces."""

from pathlib import Path

import pytest
import torch

from slime.utils.tiny_model import build_tiny_model
from tests.helpers.tp_ranks import build_runner, randomize_biases_and_norms, rank_parallel, run_steps, spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
NUM_DECODE_STEPS = 6
CASES = {"qwen3_one_kv_head": ("qwen3_one_kv_head", 1), "qwen3_moe_tp2": ("qwen3_moe", 1),
         "qwen3_moe_tp2_ep2": ("qwen3_moe", 2)}
# Sizes the GPU kernels accept (16-byte aligned rows of grouped_mm, power-of-two head dims).
CHECKPOINTS = {
    "qwen3_one_kv_head": dict(arch="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                              intermediate_size=512),
    "qwen3_moe": dict(arch="qwen3_moe", hidden_size=256, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=128),
}
GPU = {"device": "cuda", "dtype": "float32"}


def _worker(rank, world_size, paths, out_dir):
    for case, (checkpoint, ep_size) in CASES.items():
        parallel = rank_parallel(rank, world_size, ep_size)
        runner = build_runner(paths[checkpoint], parallel, enable_return_routed_experts="moe" in case, **GPU)
        record = run_steps(runner, NUM_DECODE_STEPS, parallel)
        record["paths"] = (runner.use_triton, runner.use_cuda_graphs, runner.decode_graphs is not None)
        torch.save(record, Path(out_dir) / f"{case}.rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_model_cuda")
    paths = {name: str(build_tiny_model(root / name, initializer_range=0.1, **overrides))
             for name, overrides in CHECKPOINTS.items()}
    for path in paths.values():
        randomize_biases_and_norms(path, std=0.1)
    out_dir = root / "out"
    out_dir.mkdir()
    spawn_ranks(_worker, 2, paths, str(out_dir), backend="nccl")
    return paths, out_dir


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_on_two_gpus_equals_one_gpu(results, case):
    paths, out_dir = results
    checkpoint, _ = CASES[case]
    reference = run_steps(build_runner(paths[checkpoint], enable_return_routed_experts="moe" in case, **GPU),
                          NUM_DECODE_STEPS)
    got = torch.load(out_dir / f"{case}.rank0.pt", weights_only=False)
    print(case, "triton, cuda graphs, decode graphs used:", got["paths"])
    for step, (logits, expected) in enumerate(zip(got["logits"], reference["logits"])):
        assert (logits - expected).abs().max().item() < 1e-3, step  # cuBLAS picks other kernels per shape
    assert got["tokens"] == reference["tokens"]
    for log_probs, expected in zip(got["log_probs"], reference["log_probs"]):
        assert max(abs(a - b) for a, b in zip(log_probs, expected)) < 1e-3
    if "routed_experts" in reference:
        for routed, expected in zip(got["routed_experts"], reference["routed_experts"]):
            assert (routed == expected).all()
