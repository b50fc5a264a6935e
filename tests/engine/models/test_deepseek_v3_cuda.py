"""The DeepSeek-V3-family engine on CUDA: the start-up self-check turns the MLA Triton kernel on, and fp32 greedy
tokens and log-probs through it (decode CUDA graphs included) equal transformers' and the eager run's; bf16 runs
through the graphs and agrees with its eager run."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from tests.helpers.greedy_margin import assert_clear_greedy_margin
from tests.helpers.mla_checkpoints import build_mla_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
PROMPTS = [[10, 20, 30, 40, 50, 60, 70, 80, 90], [9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 33], [300, 3]]


@pytest.fixture(scope="module", params=["deepseek_v3", "moonlight"])
def checkpoint(request, tmp_path_factory):
    return build_mla_checkpoint(tmp_path_factory.mktemp(request.param), request.param)[0]


def engine_on(path, dtype: str, enforce_eager: bool) -> Engine:
    return Engine(str(path), device="cuda", dtype=dtype, enforce_eager=enforce_eager, gpu_memory_utilization=0.2,
                  max_num_seqs=8, kvcache_block_size=16)


def test_fp32_kernel_and_graphs_match_transformers(checkpoint):
    """The reference is transformers on the CPU (fp32, no TF32). Decode graphs run when this torch's grouped_mm
    captures fp32 (today: bf16 only, so the graphs are checked in bf16 below)."""
    engine = engine_on(checkpoint, "float32", enforce_eager=False)
    grouped = all(block.experts.use_grouped_mm for block in engine.model_runner.model.moe_blocks())
    assert engine.model_runner.use_triton and engine.model_runner.use_cuda_graphs == grouped
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outputs = engine.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert_clear_greedy_margin(hf, prompt, expected)
        assert output["output_ids"] == expected
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1 : -1].float()
        hf_log_probs = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None]).squeeze(1)
        assert (torch.tensor(output["output_log_probs"]) - hf_log_probs).abs().max() < 1e-4


def test_bf16_graphs_equal_eager(checkpoint):
    engine = engine_on(checkpoint, "bfloat16", enforce_eager=False)
    assert engine.model_runner.use_cuda_graphs
    graphed = engine.generate(PROMPTS, GREEDY)
    eager = engine_on(checkpoint, "bfloat16", enforce_eager=True).generate(PROMPTS, GREEDY)
    for graphed_output, eager_output in zip(graphed, eager):
        assert graphed_output["output_ids"][:8] == eager_output["output_ids"][:8]
        assert graphed_output["output_log_probs"][:8] == pytest.approx(eager_output["output_log_probs"][:8], abs=5e-2)
