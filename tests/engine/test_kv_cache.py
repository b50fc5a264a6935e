"""The engine's fp8 KV cache (`kv_cache_dtype`, SGLang's --kv-cache-dtype fp8_e4m3 / fp8_e5m2) on the CPU path:
the cache is allocated in fp8 and sized by its bytes, K/V really are rounded (log-probs move a little from the
full-precision cache's), and the rounding is the same whatever the batching: chunked prefill, prefix-cache hits
and preemption give the same log-probs as a plain fp8 run. Bad values name the field."""

import pytest
import torch

from slime.engine.config import Config
from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model

PROMPTS = [[10 + i, 20, 30 + i, 40, 50, 60 + i, 70, 80, 90] for i in range(3)]
PARAMS = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.2)


def run(path, prompts=PROMPTS, **config):
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64, **config)
    return engine, engine.generate(prompts, PARAMS)


def log_probs(outputs):
    return torch.tensor([lp for output in outputs for lp in output["output_log_probs"]], dtype=torch.float64)


def log_prob_difference_where_drawn_alike(outputs, reference_outputs):
    """|log-prob difference| over the requests whose tokens match the reference's. Same seeds: the draws match
    unless a rounding moved a score across another (then the log-probs are of other tokens, not comparable)."""
    same = [o["output_ids"] == e["output_ids"] for o, e in zip(outputs, reference_outputs)]
    assert any(same)
    return torch.cat([(log_probs([o]) - log_probs([e])).abs()
                      for o, e, equal in zip(outputs, reference_outputs, same) if equal])


@pytest.mark.parametrize("kv_cache_dtype, torch_dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                                         ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_cache_stores_a_quarter_of_the_bytes_and_rounds_k_and_v(path, kv_cache_dtype, torch_dtype):
    full, full_outputs = run(path)
    engine, outputs = run(path, kv_cache_dtype=kv_cache_dtype)
    assert engine.model_runner.kv_cache.dtype == torch_dtype
    assert full.model_runner.kv_cache.dtype == torch.float32
    assert engine.model_runner.bytes_per_block * 4 == full.model_runner.bytes_per_block
    assert engine.model_runner.kv_cache.element_size() == 1
    assert all(len(output["output_ids"]) == 12 for output in outputs)
    difference = log_prob_difference_where_drawn_alike(outputs, full_outputs)
    assert difference.max() > 1e-6, "an fp8 cache that changes nothing is not rounding K/V"
    assert difference.max() < 0.5, "K/V read back as something else than their rounded values"


def test_fp8_rounding_does_not_depend_on_the_batching(path):
    _, plain = run(path, kv_cache_dtype="fp8_e4m3")
    _, chunked = run(path, kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=5)
    assert [o["output_ids"] for o in chunked] == [o["output_ids"] for o in plain]
    torch.testing.assert_close(log_probs(chunked), log_probs(plain), atol=1e-4, rtol=0)
    # The same prompts again on one engine: the second pass reads the first's cached prefix blocks (fp8 as stored).
    engine, _ = run(path, kv_cache_dtype="fp8_e4m3")
    again = engine.generate(PROMPTS, PARAMS)
    assert all(output["cached_tokens"] >= 8 for output in again)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in plain]
    torch.testing.assert_close(log_probs(again), log_probs(plain), atol=1e-4, rtol=0)


def test_bad_kv_cache_dtypes_name_the_field(path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Config(model="m", kv_cache_dtype="fp4_e2m1")
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' differs from the model dtype torch.float32"):
        Engine(str(path), device="cpu", num_kvcache_blocks=8, kv_cache_dtype="bfloat16")
    engine = Engine(str(path), device="cpu", num_kvcache_blocks=8, kv_cache_dtype="float32")  # the model's: fine
    assert engine.model_runner.kv_cache.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_cache_on_cuda_runs_the_triton_path_and_cuda_graphs(path):
    """On CUDA the fp8 cache goes through the Triton kernels (their start-up self-checks pass with it) and the
    decode CUDA graphs; bf16 model, log-probs near the bf16 cache's on the tokens both runs drew."""
    config = dict(device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=64)
    full = Engine(str(path), **config)
    engine = Engine(str(path), **config, kv_cache_dtype="fp8_e4m3")
    assert engine.model_runner.use_triton and engine.model_runner.use_cuda_graphs
    assert engine.model_runner.kv_cache.dtype == torch.float8_e4m3fn
    outputs, full_outputs = engine.generate(PROMPTS, PARAMS), full.generate(PROMPTS, PARAMS)
    assert engine.model_runner.decode_graphs is not None  # the decode steps replayed graphs
    difference = log_prob_difference_where_drawn_alike(outputs, full_outputs)
    assert 0 < difference.max() < 0.5
