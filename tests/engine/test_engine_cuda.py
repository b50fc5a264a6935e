"""The engine on CUDA (skipped without a GPU): the Triton attention path with CUDA-graph decode must match
transformers in fp32 (greedy tokens, log-probs) and within bf16 tolerance in bf16, give the eager path's tokens,
survive release / resume of weights and KV cache (graphs re-captured), and run in bf16 with the KV cache sized from
gpu_memory_utilization."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[10, 20, 30, 40, 50], list(range(5, 40))]
GREEDY = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def path(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, initializer_range=0.2)


def test_fp32_cuda_matches_transformers(path):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    engine = Engine(str(path), device="cuda", dtype="float32", num_kvcache_blocks=256)
    assert engine.model_runner.use_triton and engine.model_runner.use_cuda_graphs
    outputs = engine.generate(PROMPTS, GREEDY)
    assert engine.model_runner.decode_graphs is not None
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


def _device_bytes_in_use() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_bf16_cuda_sizes_cache_and_runs(path):
    # Process-wide allocations that outlive earlier tests (e.g. cuBLAS workspaces of the graph-capture stream) are
    # not this engine's: measure against the memory in use before it exists. Device-wide, not torch's count: the
    # KV cache is mapped by the engine (device_arena.py), outside torch's allocator.
    baseline = _device_bytes_in_use()
    engine = Engine(str(path), device="cuda", kvcache_block_size=16, gpu_memory_utilization=0.2)
    assert engine.model_runner.dtype == torch.bfloat16
    assert engine.model_runner.model.model.rotary.cos.dtype == torch.float32
    assert engine.block_manager.num_blocks > 100
    engine_bytes = _device_bytes_in_use() - baseline
    engine.release_memory(None)
    assert _device_bytes_in_use() - baseline < engine_bytes / 2
    engine.resume_memory(None)
    outputs = engine.generate([PROMPTS[1]] * 64, {"temperature": 1.0, "max_new_tokens": 128, "ignore_eos": True})
    assert all(o["completion_tokens"] == 128 for o in outputs)


def test_cuda_graph_decode_equals_eager(path):
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(5)]  # 5 sequences: replayed in the bucket of 8
    sampled = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 7}
    results = []
    for enforce_eager in (True, False):
        engine = Engine(str(path), device="cuda", dtype="float32", num_kvcache_blocks=256, enforce_eager=enforce_eager)
        results.append(engine.generate(prompts, GREEDY) + engine.generate(prompts, sampled))
        assert (engine.model_runner.decode_graphs is None) == enforce_eager
    for eager, graphed in zip(*results):
        assert graphed["output_ids"] == eager["output_ids"]
        assert graphed["output_log_probs"] == pytest.approx(eager["output_log_probs"], abs=1e-4)


def test_bf16_logits_within_bf16_tolerance_of_transformers(path):
    """Engine bf16 error against fp32 transformers is at most a small multiple of transformers' own bf16 error."""
    token_ids = [(7 * i + 3) % 500 for i in range(40)]
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
        reference = hf32(torch.tensor([token_ids]).cuda()).logits[0].float()
        hf16 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
        hf_bf16 = hf16(torch.tensor([token_ids]).cuda()).logits[0].float()
    engine = Engine(str(path), device="cuda", dtype="bfloat16", kvcache_block_size=4, num_kvcache_blocks=64)
    seq = Sequence("s", token_ids, SamplingParams(), seed=0)
    logits = []
    for num_new_tokens in [25] + [1] * 15:  # prefill, then decode steps through the paged cache
        end = seq.num_computed_tokens + num_new_tokens
        engine.block_manager.grow(seq, end)
        logits.append(engine.model_runner.forward_logits([ScheduledSequence.of(seq, num_new_tokens)]))
        seq.num_computed_tokens = end
    engine_error = (torch.cat(logits) - reference).abs()
    hf_error = (hf_bf16 - reference).abs()
    assert engine_error.mean() <= 2 * hf_error.mean() + 1e-3
    assert engine_error.max() <= 4 * hf_error.max() + 1e-2
