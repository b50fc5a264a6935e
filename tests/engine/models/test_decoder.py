"""The engine's own Qwen2 / Qwen3 / Llama / Qwen3-MoE / Qwen2-MoE implementations against transformers on the same
tiny checkpoints: logits of a prefill, of a chunked prefill and of incremental decode through the paged KV cache
(fp32, < 1e-4), greedy continuation identical to `generate(do_sample=False)` for 64 tokens, sharded checkpoints,
unsupported architectures."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.greedy_margin import assert_clear_greedy_margin

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
ARCHES = {
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", max_shard_size="40KB"),
    "llama": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
    "qwen3_moe": dict(arch="qwen3_moe"),
    # Layer 1 dense (mlp_only_layers), so the mixed dense / sparse stack and its weight names are exercised.
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1]),
}


@pytest.fixture(scope="module", params=list(ARCHES))
def checkpoint(request, tmp_path_factory):
    # A large init std makes logits peaked and position-dependent, so mismatches show up.
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), initializer_range=0.3, **ARCHES[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128)
    return request.param, path, hf, engine


def hf_logits(hf, token_ids):
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def run_chunks(engine, seq, chunk_sizes):
    """Forward `seq` through the paged cache in the given chunk sizes; returns the logits of every token."""
    logits = []
    for num_new_tokens in chunk_sizes:
        end = seq.num_computed_tokens + num_new_tokens
        engine.block_manager.grow(seq, end)
        logits.append(engine.model_runner.forward_logits([ScheduledSequence.of(seq, num_new_tokens)]))
        seq.num_computed_tokens = end
    engine.block_manager.free(seq)
    return torch.cat(logits)


def test_config_variant_is_exercised(checkpoint):
    arch, path, hf, engine = checkpoint
    config = engine.model_config
    assert config.qkv_bias == arch.startswith("qwen2") and config.qk_norm == arch.startswith("qwen3")
    assert config.is_moe == arch.endswith("_moe")
    if arch == "qwen2_moe":
        assert config.moe_layers == (0, 2) and config.shared_expert_intermediate_size == 64
    assert (config.rope_scaling is not None) == (arch == "llama")
    assert (arch == "qwen3") == (path / "model.safetensors.index.json").is_file()
    if arch == "qwen3":
        assert len(list(path.glob("*.safetensors"))) > 1


def test_prefill_and_paged_decode_logits_match_transformers(checkpoint):
    _, _, hf, engine = checkpoint
    token_ids = [(7 * i + 3) % engine.model_config.vocab_size for i in range(30)]
    reference = hf_logits(hf, token_ids)
    for chunks in ([30], [11, 9, 10], [13] + [1] * 17):  # prefill, chunked prefill, prefill + decode
        seq = Sequence("s", token_ids, SamplingParams(), seed=0)
        logits = run_chunks(engine, seq, chunks)
        assert (logits - reference).abs().max().item() < 1e-4, chunks


def test_mixed_batch_logits_match_transformers(checkpoint):
    _, _, hf, engine = checkpoint
    vocab = engine.model_config.vocab_size
    a = [(5 * i + 1) % vocab for i in range(21)]
    b = [(11 * i + 2) % vocab for i in range(9)]
    seq_a, seq_b = Sequence("a", a, SamplingParams(), 0), Sequence("b", b, SamplingParams(), 0)
    for seq, n in ((seq_a, 17), (seq_b, 5)):  # a has 4 tokens left (prefill chunk), b 4 (prefill chunk)
        engine.block_manager.grow(seq, n)
        seq.num_computed_tokens = n
        engine.model_runner.forward_logits([ScheduledSequence(seq, 0, n, False)])
    engine.block_manager.grow(seq_a, 21)
    engine.block_manager.grow(seq_b, 9)
    logits = engine.model_runner.forward_logits([ScheduledSequence.of(seq_a, 4), ScheduledSequence.of(seq_b, 4)])
    expected = torch.cat([hf_logits(hf, a)[17:], hf_logits(hf, b)[5:]])
    engine.block_manager.free(seq_a)
    engine.block_manager.free(seq_b)
    assert (logits - expected).abs().max().item() < 1e-4


def test_greedy_64_tokens_matches_transformers_generate(checkpoint):
    _, _, hf, engine = checkpoint
    prompts = [[10, 20, 30, 40, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 33]]
    outputs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True})
    hf.generation_config.eos_token_id = None  # like ignore_eos: run the full 64 tokens, EOS allowed
    for prompt, output in zip(prompts, outputs):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, pad_token_id=0)
        expected = expected[0, len(prompt) :].tolist()
        assert_clear_greedy_margin(hf, prompt, expected)
        assert output["output_ids"] == expected
        assert output["finish_reason"] == {"type": "length", "length": 64}
        assert output["completion_tokens"] == 64 and output["prompt_tokens"] == len(prompt)
        assert len(set(expected)) > 3  # a real continuation, not one repeated token


def test_named_weight_shapes_are_hf_names(checkpoint):
    arch, path, hf, engine = checkpoint
    engine_shapes = {name: shape for name, (shape, _) in engine.named_weight_shapes().items()}
    if not arch.endswith("_moe"):  # transformers 5 stacks MoE experts in memory; the checkpoint below does not
        hf_shapes = {name: tuple(t.shape) for name, t in hf.state_dict().items() if name != "lm_head.weight"}
        assert engine_shapes == hf_shapes
    assert engine_shapes == {name: tuple(tensor.shape) for name, tensor in iterate_checkpoint(path)}


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = build_tiny_model(tmp_path, arch="qwen3")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'.*qwen2.*qwen3.*llama"):
        Engine(str(path))


def test_unknown_config_field_is_named(checkpoint):
    _, path, _, _ = checkpoint
    with pytest.raises(ValueError, match="max_num_seq"):
        Engine(str(path), max_num_seq=4)
    with pytest.raises(ValueError, match="kvcache_block_size"):
        Engine(str(path), kvcache_block_size=0)
