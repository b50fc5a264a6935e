"""--true-on-policy-mode on a tiny Qwen3-MoE with routing replay R3, on the CPU: the engine's reported log-probs equal,
bit for bit, the trainer-side computation (backends/true_on_policy.py over transformers' parameters) replaying the
experts the engine reported, through batching, chunked prefill and prefix-cache hits; the engine's reported experts
are the shared router's own picks; replaying other experts changes the numbers (the replay is really applied); and
the shared MoE decoder computes transformers' function."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.backends.routing_replay import pack_routing
from slime.backends.true_on_policy import TileLayout, head_log_probs_and_entropy, hf_layer_weights, layer_over_samples
from slime.engine.engine import Engine
from slime.engine.models.model_config import load_model_config
from slime.engine.true_on_policy.contract import decoder_spec
from slime.utils.tiny_model import build_tiny_model

SAMPLING = {"temperature": 0.8, "max_new_tokens": 20, "ignore_eos": True}
PROMPTS = [[5 + i, 17, 30 + 3 * i, 41, 50, 61 + i, 77, 90, 12 + i, 33, 45, 58, 66, 71, 80, 99, 101, 7][: 9 + 3 * i]
           for i in range(3)]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """Every weight matrix and expert tensor std 0.15 (norms stay 1): logits and router scores spread."""
    folder = build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def trainer_log_probs(checkpoint, sequences, num_prompt_tokens, routing_records, device="cpu", dtype=torch.float32):
    """Per sequence: the trainer's log-probs of its response tokens, all packed into one micro-batch, its MoE layers
    replaying `routing_records` (the engine's [len - 1, layers, top_k] per sequence; None: route freely), with the
    weights in `dtype` on `device` (the trainer's mixed-precision compute weights)."""
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval().to(device, dtype)
    spec = decoder_spec(load_model_config(checkpoint))
    decoder, config = hf.get_decoder(), hf.config
    lengths = [len(s) for s in sequences]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.tensor([t for s in sequences for t in s], device=device)
    layout = TileLayout(tuple(lengths))
    if routing_records is not None:
        routing = pack_routing(routing_records, lengths, [str(i) for i in range(len(lengths))],
                               config.num_hidden_layers, config.num_experts_per_tok, config.num_experts)
        layout = layout.with_routing(routing.to(device), cu)
    logit_index = torch.cat([torch.arange(cu[i] + p - 1, cu[i + 1] - 1) for i, p in enumerate(num_prompt_tokens)])
    logit_index = logit_index.to(device)
    targets = input_ids[logit_index + 1]
    with torch.no_grad():
        hidden = layout.embed(input_ids, cu.tolist(), decoder.embed_tokens.weight)
        for index, layer in enumerate(decoder.layers):
            hidden = layer_over_samples(spec, hf_layer_weights(layer), hidden, layout, index)
        log_probs, _ = head_log_probs_and_entropy(hidden, decoder.norm.weight, hf.lm_head.weight, spec, layout,
                                                  logit_index, targets, cu, SAMPLING["temperature"])
    return log_probs.cpu().split([n - p for n, p in zip(lengths, num_prompt_tokens)]), hf


def generate_with_routing(engine, prompts):
    rids = [engine.add_request(p, dict(SAMPLING, sampling_seed=100 + i), return_routed_experts=True)
            for i, p in enumerate(prompts)]
    outputs = {}
    while len(outputs) < len(rids):
        outputs.update({output.rid: output for output in engine.step() if output.finished})
    return [outputs[rid] for rid in rids]


def make_engine(checkpoint, **config):
    config = {"device": "cpu", **config}
    return Engine(str(checkpoint), kvcache_block_size=4, num_kvcache_blocks=256, true_on_policy=True,
                  enable_return_routed_experts=True, **config)


def assert_bitwise(checkpoint, outputs, routing_records, **where):
    sequences = [p + o.output_token_ids for p, o in zip(PROMPTS, outputs)]
    expected, _ = trainer_log_probs(checkpoint, sequences, [len(p) for p in PROMPTS], routing_records, **where)
    for output, want in zip(outputs, expected):
        got = torch.tensor(output.output_log_probs, dtype=torch.float64)
        assert torch.equal(got, want.double()), (got - want.double()).abs().max()


def test_moe_engine_equals_trainer_replaying_its_routing_bitwise(moe_checkpoint):
    engine = make_engine(moe_checkpoint, max_num_batched_tokens=5)
    outputs = generate_with_routing(engine, PROMPTS)
    records = [o.routed_experts for o in outputs]
    assert all(r.shape == (len(p) + len(o.output_token_ids) - 1, 2, 2) for r, p, o in zip(records, PROMPTS, outputs))
    assert len(np.unique(np.concatenate([r.reshape(-1) for r in records]))) > 4  # tokens spread over the experts
    assert_bitwise(moe_checkpoint, outputs, records)
    assert_bitwise(moe_checkpoint, outputs, None)  # the engine's picks are the shared router's own
    again = generate_with_routing(engine, PROMPTS)  # prefix-cache hits recompute (and re-record) the prefix
    assert any(o.num_cached_tokens > 0 for o in again)
    assert [o.output_log_probs for o in again] == [o.output_log_probs for o in outputs]
    for first, second in zip(records, [o.routed_experts for o in again]):
        np.testing.assert_array_equal(first, second)


@pytest.mark.gpu
def test_bf16_moe_engine_on_cuda_equals_trainer_replaying_its_routing_bitwise(moe_checkpoint):
    engine = make_engine(moe_checkpoint, device="cuda", dtype="bfloat16", max_num_batched_tokens=5)
    outputs = generate_with_routing(engine, PROMPTS)
    assert_bitwise(moe_checkpoint, outputs, [o.routed_experts for o in outputs], device="cuda", dtype=torch.bfloat16)


def test_replaying_other_experts_changes_the_log_probs(moe_checkpoint):
    outputs = generate_with_routing(make_engine(moe_checkpoint), PROMPTS)
    records = [(o.routed_experts + 1) % 8 for o in outputs]  # every token sent to other experts
    sequences = [p + o.output_token_ids for p, o in zip(PROMPTS, outputs)]
    replayed, _ = trainer_log_probs(moe_checkpoint, sequences, [len(p) for p in PROMPTS], records)
    for output, got in zip(outputs, replayed):
        assert (torch.tensor(output.output_log_probs) - got).abs().max() > 1e-3


def test_shared_moe_decoder_computes_the_transformers_function(moe_checkpoint):
    sequences = [p + [3 * i + 1 for i in range(12)] for p in PROMPTS]
    ours, hf = trainer_log_probs(moe_checkpoint, sequences, [len(p) for p in PROMPTS], None)
    for sequence, prompt, got in zip(sequences, PROMPTS, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0].double() / SAMPLING["temperature"]
        reference = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
            -1, torch.tensor(sequence[len(prompt):])[:, None]).squeeze(-1)
        assert reference.std() > 0.5
        torch.testing.assert_close(got.double(), reference, atol=2e-5, rtol=0)
