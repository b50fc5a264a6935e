"""The engine's LoRA on CUDA (skipped without a GPU): Triton attention, fused kernels, the overlap schedule and
decode CUDA graphs on LoRA's dense path (engine/lora/slots.py; prefill runs eagerly). fp32: an adapter's log-probs
equal transformers with the adapter merged; bf16: within bf16 tolerance; one step mixing two adapters and the base
model gives each request what it gets alone, and the graphs give the eager engine's tokens."""

import pytest
import torch
from transformers import AutoConfig

from slime.engine.engine import Engine
from slime.engine.lora.adapter import adapter_from_tensors
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.lora_adapters import merged_log_probs, random_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [list(range(10 + i, 40 + i)) for i in range(3)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.5)


@pytest.fixture(scope="module")
def adapters(path):
    hf_config = AutoConfig.from_pretrained(str(path))
    return {"one": random_adapter(hf_config, rank=8, alpha=16, seed=1),
            "two": random_adapter(hf_config, rank=4, alpha=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))}


def engine_with(path, adapters, dtype, enforce_eager=False):
    engine = Engine(str(path), device="cuda", dtype=dtype, num_kvcache_blocks=256, enable_lora=True,
                    max_lora_rank=8, max_loras_per_batch=2, enforce_eager=enforce_eager)
    assert engine.model_runner.use_triton and engine.model_runner.use_cuda_graphs != enforce_eager
    for name, (config, tensors) in adapters.items():
        engine.load_lora_adapter(name, adapter_from_tensors(config, tensors.items(), 8))
    return engine


def run(engine, jobs):
    rids = {engine.add_request(prompt, GREEDY, incremental=False, lora_name=name): (i, name)
            for i, (prompt, name) in enumerate(jobs)}
    finished = {}
    while len(finished) < len(rids):
        finished.update({rids[o.rid]: o.to_dict() for o in engine.step() if o.finished})
    return finished


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_adapters_match_merged_transformers(path, adapters, dtype):
    """fp32: within 2e-3 of transformers on the merged weights (measured on an H100: at most 5.3e-6). bf16: the
    base model's own bf16 rounding already moves these wide logits' log-probs by up to ~0.16 (H100), so an
    adapter's requests must stay within twice the base requests' error, while the adapters move log-probs by far
    more than that (a dropped or wrong adapter path would show as an error of the adapter's size)."""
    engine = engine_with(path, adapters, dtype)
    jobs = [(prompt, name) for prompt in PROMPTS for name in ("one", "two", None)]
    mixed = run(engine, jobs)
    assert engine.model_runner.decode_graphs.graphs  # decode steps replayed graphs (LoRA's dense path)
    eager = run(engine_with(path, adapters, dtype, enforce_eager=True), jobs)
    errors, effects = {}, {}
    for (i, name), output in mixed.items():
        prompt = jobs[i][0]
        config, tensors = adapters[name] if name else (None, None)
        full = prompt + output["output_ids"]
        expected = merged_log_probs(path, config, tensors, full, len(prompt))
        error = max(abs(a - b) for a, b in zip(output["output_log_probs"], expected))
        errors[name] = max(errors.get(name, 0.0), error)
        if name:
            base = merged_log_probs(path, None, None, full, len(prompt))
            effects[name] = max(effects.get(name, 0.0), max(abs(a - b) for a, b in zip(expected, base)))
        if dtype == "float32":  # one request alone, and the eager engine: the same tokens as inside the mixed step
            assert error < 2e-3, (name, error)
            alone = next(iter(run(engine, [(prompt, name)]).values()))
            assert alone["output_ids"] == output["output_ids"] == eager[i, name]["output_ids"]
    if dtype == "bfloat16":
        for name in ("one", "two"):
            assert errors[name] <= 2 * max(errors[None], 0.02), errors
            assert effects[name] > 4 * errors[name], (effects, errors)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_serve_adapters_as_one_gpu(path, adapters):
    """tp_size 2 (NCCL, decode CUDA graphs on LoRA's dense path with the row-parallel all-reduce inside) against one
    GPU with the same adapters, fp32: the same tokens, log-probs within 1e-3."""
    jobs = [(prompt, name) for prompt in PROMPTS for name in ("one", "two", None)]
    results = []
    for tp_size in (1, 2):
        engine = Engine(str(path), device="cuda", dtype="float32", num_kvcache_blocks=256, enable_lora=True,
                        max_lora_rank=8, max_loras_per_batch=2, tp_size=tp_size)
        try:
            for name, (config, tensors) in adapters.items():
                engine.load_lora_adapter(name, adapter_from_tensors(config, tensors.items(), 8))
            results.append(run(engine, jobs))
            assert engine.model_runner.decode_graphs.graphs
        finally:
            engine.shutdown()
    single, sharded = results
    for key, output in single.items():
        assert sharded[key]["output_ids"] == output["output_ids"], key
        assert sharded[key]["output_log_probs"] == pytest.approx(output["output_log_probs"], abs=1e-3)
