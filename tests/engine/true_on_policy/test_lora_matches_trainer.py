"""--true-on-policy-mode with a LoRA adapter on the CPU: the engine's reported log-probs of requests served with the
adapter equal, bit for bit, the trainer-side computation over an FSDP-backend model (fsdp_utils/lora.py's LoRALinear
holding the same adapter), in one batch with base-model requests (those equal the trainer with its adapters
disabled, the reference pass); a partial adapter (some projections only) too; and the shared adapted decoder
computes transformers' function with the adapter merged into its weights (float64)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slime.backends.fsdp_utils.lora import apply_lora
from slime.backends.lora_adapter import adapters_disabled
from slime.backends.true_on_policy import TileLayout, head_log_probs_and_entropy, hf_layer_weights, layer_over_samples
from slime.engine.engine import Engine
from slime.engine.lora.adapter import adapter_from_tensors
from slime.engine.models.model_config import load_model_config
from slime.engine.true_on_policy.contract import decoder_spec
from tests.helpers.lora_adapters import merged_log_probs, random_adapter
from tests.helpers.lora_helpers import wide_tiny_checkpoint

SAMPLING = {"temperature": 0.8, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = [[5 + i, 17, 30 + 3 * i, 41, 50, 61 + i, 77, 90, 12 + i, 33, 45, 58, 66, 71, 80, 99, 101, 7][: 9 + 3 * i]
           for i in range(4)]
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARTIAL_TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return wide_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3")


def adapter(checkpoint, targets):
    return random_adapter(AutoConfig.from_pretrained(str(checkpoint)), rank=4, alpha=8, seed=1, targets=targets,
                          std=0.2)


def trainer_model(checkpoint, config, tensors, device="cpu", dtype=torch.float32):
    """The transformers model with the FSDP backend's LoRALinear on the adapter's targets, holding its tensors, in
    `dtype` on `device` (the trainer's mixed-precision compute weights)."""
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    apply_lora(hf, list(config["target_modules"]), config["r"], config["lora_alpha"], 0.0)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name.removeprefix("base_model.model.")].copy_(tensor)
    return hf.to(device, dtype)


def trainer_log_probs(hf, checkpoint, sequences, num_prompt_tokens, temperature=SAMPLING["temperature"]):
    spec = decoder_spec(load_model_config(checkpoint))
    decoder = hf.get_decoder()
    device = decoder.embed_tokens.weight.device
    lengths = [len(s) for s in sequences]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.tensor([t for s in sequences for t in s], device=device)
    layout = TileLayout(tuple(lengths))
    logit_index = torch.cat([torch.arange(cu[i] + p - 1, cu[i + 1] - 1)
                             for i, p in enumerate(num_prompt_tokens)]).to(device)
    with torch.no_grad():
        hidden = layout.embed(input_ids, cu.tolist(), decoder.embed_tokens.weight)
        for layer in decoder.layers:
            hidden = layer_over_samples(spec, hf_layer_weights(layer), hidden, layout)
        log_probs, _ = head_log_probs_and_entropy(hidden, decoder.norm.weight, hf.lm_head.weight, spec, layout,
                                                  logit_index, input_ids[logit_index + 1], cu, temperature)
    return log_probs.cpu().split([n - p for n, p in zip(lengths, num_prompt_tokens)])


def engine_outputs(checkpoint, config, tensors, lora_names, **engine_config):
    engine_config = {"device": "cpu", **engine_config}
    engine = Engine(str(checkpoint), kvcache_block_size=4, num_kvcache_blocks=256, true_on_policy=True,
                    enable_lora=True, max_lora_rank=8, **engine_config)
    engine.load_lora_adapter("policy", adapter_from_tensors(config, tensors.items(), 8))
    rids = [engine.add_request(p, dict(SAMPLING, sampling_seed=100 + i), lora_name=name)
            for i, (p, name) in enumerate(zip(PROMPTS, lora_names))]
    outputs = {}
    while len(outputs) < len(rids):
        outputs.update({output.rid: output for output in engine.step() if output.finished})
    return [outputs[rid] for rid in rids]


def assert_bitwise(hf, checkpoint, prompts, outputs):
    sequences = [p + o.output_token_ids for p, o in zip(prompts, outputs)]
    expected = trainer_log_probs(hf, checkpoint, sequences, [len(p) for p in prompts])
    for output, want in zip(outputs, expected):
        got = torch.tensor(output.output_log_probs, dtype=torch.float64)
        assert torch.equal(got, want.double()), (got - want.double()).abs().max()


@pytest.mark.parametrize("targets", [ALL_TARGETS, PARTIAL_TARGETS], ids=["all-linear", "partial"])
def test_lora_engine_equals_trainer_bitwise_beside_base_requests(checkpoint, targets):
    config, tensors = adapter(checkpoint, targets)
    names = ["policy", None, "policy", None]
    outputs = engine_outputs(checkpoint, config, tensors, names, max_num_batched_tokens=5)
    hf = trainer_model(checkpoint, config, tensors)
    adapted = [i for i, name in enumerate(names) if name]
    base = [i for i, name in enumerate(names) if not name]
    assert_bitwise(hf, checkpoint, [PROMPTS[i] for i in adapted], [outputs[i] for i in adapted])
    with adapters_disabled(hf):
        assert_bitwise(hf, checkpoint, [PROMPTS[i] for i in base], [outputs[i] for i in base])


@pytest.mark.gpu
def test_bf16_lora_engine_on_cuda_equals_trainer_bitwise(checkpoint):
    config, tensors = adapter(checkpoint, ALL_TARGETS)
    names = ["policy", None, "policy", None]
    outputs = engine_outputs(checkpoint, config, tensors, names, device="cuda", dtype="bfloat16",
                             max_num_batched_tokens=5)
    hf = trainer_model(checkpoint, config, tensors, device="cuda", dtype=torch.bfloat16)
    adapted = [i for i, name in enumerate(names) if name]
    assert_bitwise(hf, checkpoint, [PROMPTS[i] for i in adapted], [outputs[i] for i in adapted])


def test_shared_adapted_decoder_computes_the_merged_transformers_function(checkpoint):
    config, tensors = adapter(checkpoint, ALL_TARGETS)
    hf = trainer_model(checkpoint, config, tensors)
    sequences = [p + [3 * i + 1 for i in range(12)] for p in PROMPTS[:2]]
    ours = trainer_log_probs(hf, checkpoint, sequences, [len(p) for p in PROMPTS[:2]], temperature=1.0)
    for sequence, prompt, got in zip(sequences, PROMPTS, ours):
        reference = torch.tensor(merged_log_probs(checkpoint, config, tensors, sequence, len(prompt)),
                                 dtype=torch.float64)
        base = torch.tensor(merged_log_probs(checkpoint, None, None, sequence, len(prompt)), dtype=torch.float64)
        assert (reference - base).abs().max() > 0.1  # the adapter really moves the log-probs
        torch.testing.assert_close(got.double(), reference, atol=5e-5, rtol=0)
