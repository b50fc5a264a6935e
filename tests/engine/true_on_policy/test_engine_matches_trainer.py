"""--true-on-policy-mode on the CPU: the engine's reported log-probs of its sampled tokens equal, bit for bit, the
trainer-side computation of the same tokens (slime/backends/true_on_policy.py over the transformers model's own
parameters), whatever the batch, the prefill chunking or a prefix-cache hit; and the shared decoder computes the
same function as transformers (within float32 rounding)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.backends.true_on_policy import TileLayout, head_log_probs_and_entropy, hf_layer_weights, layer_over_samples
from slime.engine.engine import Engine
from slime.engine.models.model_config import load_model_config
from slime.engine.true_on_policy.contract import decoder_spec
from tests.helpers.lora_helpers import wide_tiny_checkpoint

SAMPLING = {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = [[5 + i, 17, 30 + 3 * i, 41, 50, 61 + i, 77, 90, 12 + i, 33, 45, 58, 66, 71, 80, 99, 101, 7][: 9 + 3 * i]
           for i in range(4)]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return wide_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param)


def trainer_log_probs(checkpoint, sequences: list[list[int]], num_prompt_tokens: list[int], temperature: float,
                      device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Per sequence: the trainer's log-probs of its response tokens, all sequences packed into one micro-batch
    (in `dtype`: the weights the trainer computes with under mixed precision)."""
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval().to(device, dtype)
    spec = decoder_spec(load_model_config(checkpoint))
    decoder = hf.get_decoder()
    lengths = [len(s) for s in sequences]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.tensor([t for s in sequences for t in s], device=device)
    layout = TileLayout(tuple(lengths))
    logit_index = torch.cat([torch.arange(cu[i] + p - 1, cu[i + 1] - 1) for i, p in enumerate(num_prompt_tokens)])
    logit_index = logit_index.to(device)
    targets = input_ids[logit_index + 1]
    with torch.no_grad():
        hidden = layout.embed(input_ids, cu.tolist(), decoder.embed_tokens.weight)
        for layer in decoder.layers:
            hidden = layer_over_samples(spec, hf_layer_weights(layer), hidden, layout)
        log_probs, _ = head_log_probs_and_entropy(hidden, decoder.norm.weight, hf.lm_head.weight, spec, layout,
                                                  logit_index, targets, cu, temperature)
    return log_probs.cpu().split([n - p for n, p in zip(lengths, num_prompt_tokens)]), hf


def engine_outputs(checkpoint, prompts, **config):
    config = {"device": "cpu", **config}
    engine = Engine(str(checkpoint), kvcache_block_size=4, num_kvcache_blocks=256, true_on_policy=True, **config)
    return engine, engine.generate(prompts, [dict(SAMPLING, sampling_seed=100 + i) for i in range(len(prompts))])


def assert_bitwise(checkpoint, prompts, outputs, **where):
    sequences = [p + o["output_ids"] for p, o in zip(prompts, outputs)]
    expected, _ = trainer_log_probs(checkpoint, sequences, [len(p) for p in prompts], SAMPLING["temperature"], **where)
    for output, want in zip(outputs, expected):
        got = torch.tensor(output["output_log_probs"], dtype=torch.float64)
        assert torch.equal(got, want.double()), (got - want.double()).abs().max()


def test_batched_engine_equals_trainer_bitwise(checkpoint):
    _, outputs = engine_outputs(checkpoint, PROMPTS)
    assert_bitwise(checkpoint, PROMPTS, outputs)


def test_chunked_prefill_and_prefix_cache_hits_stay_bitwise(checkpoint):
    engine, first = engine_outputs(checkpoint, PROMPTS, max_num_batched_tokens=5)
    again = engine.generate(PROMPTS, [dict(SAMPLING, sampling_seed=100 + i) for i in range(len(PROMPTS))])
    assert any(output["cached_tokens"] > 0 for output in again)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    assert [o["output_log_probs"] for o in again] == [o["output_log_probs"] for o in first]
    assert_bitwise(checkpoint, PROMPTS, again)


def test_one_at_a_time_equals_batched(checkpoint):
    _, batched = engine_outputs(checkpoint, PROMPTS)
    engine = Engine(str(checkpoint), device="cpu", kvcache_block_size=4, num_kvcache_blocks=256, true_on_policy=True)
    alone = [engine.generate([p], dict(SAMPLING, sampling_seed=100 + i))[0] for i, p in enumerate(PROMPTS)]
    assert [o["output_ids"] for o in alone] == [o["output_ids"] for o in batched]
    assert [o["output_log_probs"] for o in alone] == [o["output_log_probs"] for o in batched]


@pytest.mark.gpu
def test_bf16_engine_on_cuda_equals_trainer_bitwise(checkpoint):
    """On a GPU in bf16 (the trainer's mixed-precision weights), batched, chunked and prefix-cached."""
    where = {"device": "cuda", "dtype": torch.bfloat16}
    engine, outputs = engine_outputs(checkpoint, PROMPTS, device="cuda", dtype="bfloat16", max_num_batched_tokens=5)
    assert_bitwise(checkpoint, PROMPTS, outputs, **where)
    again = engine.generate(PROMPTS, [dict(SAMPLING, sampling_seed=100 + i) for i in range(len(PROMPTS))])
    assert any(output["cached_tokens"] > 0 for output in again)
    assert_bitwise(checkpoint, PROMPTS, again, **where)


def test_shared_decoder_computes_the_transformers_function(checkpoint):
    sequences = [p + [3 * i + 1 for i in range(20)] for p in PROMPTS]
    ours, hf = trainer_log_probs(checkpoint, sequences, [len(p) for p in PROMPTS], 1.0)
    for sequence, prompt, got in zip(sequences, PROMPTS, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0].double()
        reference = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
            -1, torch.tensor(sequence[len(prompt):])[:, None]).squeeze(-1)
        assert reference.std() > 0.5  # the logits spread: a wrong computation would show
        torch.testing.assert_close(got.double(), reference, atol=2e-5, rtol=0)
