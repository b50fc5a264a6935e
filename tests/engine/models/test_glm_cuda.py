"""GLM-4 and GLM-4.5 in the engine on CUDA: the fused Triton attention input stage runs their partial (interleaved /
rotate-half) RoPE, with Triton paged attention and decode CUDA graphs; fp32 greedy tokens (and GLM-4.5's routed
experts) equal transformers' on the GPU, graph replay equal to the eager path; bf16 runs with the router and its
correction bias kept in float32."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
# Sizes the Triton kernels and grouped_mm accept (head_dim 64: 32 rotary dims).
SHAPES = {"glm4": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
          "glm4_moe": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                           moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                           topk_group=2, use_qk_norm=True)}


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, initializer_range=0.1,
                            **SHAPES[request.param])
    return request.param, path


def _run(path, dtype: str, enforce_eager: bool, moe: bool):
    engine = Engine(str(path), device="cuda", dtype=dtype, enforce_eager=enforce_eager, gpu_memory_utilization=0.2,
                    max_num_seqs=8, enable_return_routed_experts=moe)
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(5 + i)] for i in range(4)]
    rids = [engine.add_request(prompt, GREEDY, return_routed_experts=moe) for prompt in prompts]
    outputs = {}
    while len(outputs) < len(rids):
        outputs.update({o.rid: o for o in engine.step() if o.finished})
    return prompts, [outputs[rid] for rid in rids], engine


def test_fp32_graphs_equal_eager_and_transformers(checkpoint):
    arch, path = checkpoint
    moe = arch == "glm4_moe"
    prompts, graphed, engine = _run(path, "float32", enforce_eager=False, moe=moe)
    runner = engine.model_runner
    assert runner.use_triton and all(layer.self_attn.use_triton for layer in runner.model.model.layers)
    _, eager, _ = _run(path, "float32", enforce_eager=True, moe=moe)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    for prompt, a, b in zip(prompts, graphed, eager):
        assert a.output_token_ids == b.output_token_ids
        expected = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=24,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert a.output_token_ids == expected
        if moe:
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
            assert not a.routed_experts[:, 0].any()


def test_bf16_keeps_the_router_in_float32(checkpoint):
    arch, path = checkpoint
    if arch != "glm4_moe":
        pytest.skip("dense model: no router")
    _, outputs, engine = _run(path, "bfloat16", enforce_eager=False, moe=True)
    gate = engine.model_runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert engine.model_runner.model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert all(o.num_completion_tokens == 24 for o in outputs)
