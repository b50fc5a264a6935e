"""The engine on CUDA (skipped without a GPU): the same pure-torch paged path must match transformers in fp32
(greedy tokens, log-probs), survive release / resume of weights and KV cache, and run in bf16 with the KV cache
sized from gpu_memory_utilization."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[10, 20, 30, 40, 50], list(range(5, 40))]
GREEDY = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def path(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, initializer_range=0.2)


def test_fp32_cuda_matches_transformers(path):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    engine = Engine(str(path), device="cuda", dtype="float32", num_kvcache_blocks=256)
    outputs = engine.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf.generate(torch.tensor([prompt]).cuda(), do_sample=False, max_new_tokens=64, pad_token_id=0)
        assert output["output_ids"] == expected[0, len(prompt) :].tolist()
    sampled = engine.generate(PROMPTS * 4, {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32, "ignore_eos": True})
    tokens = PROMPTS[0] + sampled[0]["output_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens]).cuda()).logits[0, len(PROMPTS[0]) - 1 : -1].float()
    expected = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(sampled[0]["output_ids"]).cuda()[:, None])
    assert torch.tensor(sampled[0]["output_log_probs"]) == pytest.approx(expected.squeeze(1).cpu(), abs=1e-4)
    assert [o["cached_tokens"] for o in sampled][4:] == [0, 32, 0, 32]
    engine.release_memory(None)
    engine.resume_memory(None)
    assert engine.generate(PROMPTS, GREEDY)[0]["output_ids"] == outputs[0]["output_ids"]


def test_bf16_cuda_sizes_cache_and_runs(path):
    engine = Engine(str(path), device="cuda", kvcache_block_size=16, gpu_memory_utilization=0.2)
    assert engine.model_runner.dtype == torch.bfloat16
    assert engine.model_runner.model.model.rotary.cos.dtype == torch.float32
    assert engine.block_manager.num_blocks > 100
    before = torch.cuda.memory_allocated()
    engine.release_memory(None)
    assert torch.cuda.memory_allocated() < before / 2
    engine.resume_memory(None)
    outputs = engine.generate([PROMPTS[1]] * 64, {"temperature": 1.0, "max_new_tokens": 128, "ignore_eos": True})
    assert all(o["completion_tokens"] == 128 for o in outputs)
