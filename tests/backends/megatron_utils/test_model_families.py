"""Megatron backend, one process (TP=1), on tiny GLM-4, GLM-4.5, DeepSeek-V3 (MLA, YaRN, 4 expert groups of which 2
are kept), Moonlight-like (MLA without q_lora) and GLM-4.7-Flash-like checkpoints built with transformers: the
forward over a packed THD batch equals transformers' per sample, HF -> Megatron -> HF is bit-exact (a saved
checkpoint keeps the routers' expert-score correction biases; a weight push leaves them out), the bias is loaded (a
zero bias routes differently) and training steps leave it unchanged, Kimi K2's `kimi_k2` config reads as
DeepSeek-V3's, and configurations megatron-core cannot compute as transformers does are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from slime.utils.misc import find_free_port
from tests.helpers.megatron_families import FAMILIES, FLASH, build_family_checkpoint
from tests.helpers.megatron_helpers import build_megatron, make_megatron_args

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module", params=[*FAMILIES, FLASH])
def checkpoint(request, tmp_path_factory):
    return build_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture
def megatron_model(checkpoint):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    chunks, hf_config = build_megatron(make_megatron_args(checkpoint), 0, 1, find_free_port())
    yield checkpoint, chunks, hf_config
    destroy_model_parallel()


def _logits(chunks, hf_config):
    from slime.backends.megatron_utils.log_probs import output_weight
    from slime.backends.megatron_utils.micro_batches import thd_input
    from slime.backends.packing import pack_samples

    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, hf_config.vocab_size, (n,), generator=generator).tolist() for n in (7, 12, 4)]
    inputs = thd_input(pack_samples(tokens, [3, 5, 2], [0, 1, 2]), torch.device("cpu"), pad_multiple=1)
    chunks[0].eval()
    with torch.no_grad():
        hidden = chunks[0](inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
    return tokens, (hidden @ output_weight(chunks[0], hf_config.vocab_size).t())[0]


def test_forward_equals_transformers(megatron_model):
    from transformers import AutoModelForCausalLM

    checkpoint, chunks, hf_config = megatron_model
    tokens, logits = _logits(chunks, hf_config)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.cat([hf(torch.tensor(t)[None]).logits[0] for t in tokens])
    assert reference.std() > 0.5  # wide enough that a wrong computation shows
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)


def test_kimi_k2_model_type_reads_as_deepseek_v3(tmp_path):
    """Kimi K2 ships DeepSeek-V3's architecture under model_type "kimi_k2" (remote code transformers lacks)."""
    import json

    from transformers import AutoModelForCausalLM

    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    checkpoint = build_family_checkpoint(tmp_path / "kimi", "deepseek_v3")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (checkpoint / "config.json").write_text(json.dumps(config))
    chunks, hf_config = build_megatron(make_megatron_args(checkpoint), 0, 1, find_free_port())
    try:
        tokens, logits = _logits(chunks, hf_config)
        with torch.no_grad():
            reference = torch.cat([hf(torch.tensor(t)[None]).logits[0] for t in tokens])
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)
    finally:
        destroy_model_parallel()


def test_refuses_a_quantized_checkpoint(tmp_path):
    import json

    from slime.backends.megatron_utils.hf_config import load_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    with pytest.raises(ValueError, match="fp8_cast_bf16"):
        load_hf_config(tmp_path)


def test_hf_round_trip_is_bit_exact(megatron_model, tmp_path):
    from safetensors.torch import load_file

    from slime.backends.megatron_utils.hf_weights import model_hf_weights, save_hf_checkpoint

    checkpoint, chunks, hf_config = megatron_model
    original = load_file(str(checkpoint / "model.safetensors"))
    save_hf_checkpoint(chunks, hf_config, tmp_path / "saved", checkpoint)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    pushed = dict(model_hf_weights(chunks, hf_config))  # what weight sync sends: no buffers
    biases = {name for name in original if name.endswith("e_score_correction_bias")}
    assert set(pushed) == set(original) - biases
    assert bool(biases) == (hf_config.model_type != "glm4")


def test_expert_bias_is_loaded_and_chooses_experts(megatron_model):
    _, chunks, hf_config = megatron_model
    if hf_config.model_type == "glm4":
        pytest.skip("dense")
    routers = [layer.mlp.router for layer in chunks[0].decoder.layers if hasattr(layer.mlp, "router")]
    assert routers and all(router.expert_bias.abs().max() > 0.05 for router in routers)
    assert all(router.config.moe_router_bias_update_rate == 0 for router in routers)
    _, logits = _logits(chunks, hf_config)
    for router in routers:
        router.expert_bias.zero_()
    _, unbiased = _logits(chunks, hf_config)
    assert (logits - unbiased).abs().max() > 1e-2


@pytest.mark.parametrize("family, field, overrides", [
    ("glm4_moe", "norm_topk_prob", dict(norm_topk_prob=False)),
    ("deepseek_v3", "num_experts_per_tok", dict(num_experts_per_tok=1)),
    ("deepseek_v3", "n_group", dict(n_group=8, topk_group=4)),  # groups of one expert: no top-2 group score
    ("deepseek_v3", "topk_group", dict(n_group=4, topk_group=1, num_experts_per_tok=3)),  # 2 experts kept < 3
    ("deepseek_v3", "rope_interleave", dict(rope_interleave=False)),
    ("deepseek_v3", "moe_layer_freq", dict(moe_layer_freq=2)),
    ("glm4_moe", "rope_parameters", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
])
def test_refuses_what_megatron_cannot_compute(family, field, overrides):
    from types import SimpleNamespace

    from slime.backends.megatron_utils.family_config import family_fields
    from tests.helpers.megatron_families import family_config

    args = SimpleNamespace(sequence_parallel=False, moe_grouped_gemm=False, moe_router_dtype=None,
                           tensor_model_parallel_size=1)
    with pytest.raises(ValueError, match=f"field {field} "):
        family_fields(args, family_config(family, 300, **overrides))


def test_refuses_one_latent_attention_head_per_tensor_parallel_rank():
    from types import SimpleNamespace

    from slime.backends.megatron_utils.family_config import family_fields
    from tests.helpers.megatron_families import family_config

    args = SimpleNamespace(sequence_parallel=True, moe_grouped_gemm=False, moe_router_dtype=None,
                           tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 4"):
        family_fields(args, family_config("moonlight", 300))


def test_training_steps_leave_the_expert_bias_and_weight_sync_leaves_it_out(tmp_path):
    """Two optimizer steps of the backend move the weights, not the routers' expert-score correction biases (bias
    update rate 0: the engine keeps routing with the checkpoint's); the weights pushed to engines carry no bias."""
    from safetensors.torch import load_file

    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = build_family_checkpoint(tmp_path / "glm4_moe", "glm4_moe")
    biases, pushed = run_distributed(_train_two_steps, 1, checkpoint)[0]
    original = load_file(str(checkpoint / "model.safetensors"))
    expected = {name: tensor for name, tensor in original.items() if name.endswith("e_score_correction_bias")}
    assert set(biases) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(biases[name], tensor), name
    assert set(pushed) == set(original) - set(expected)
    assert not torch.equal(pushed["model.layers.1.mlp.gate.weight"], original["model.layers.1.mlp.gate.weight"])


def _train_two_steps(rank, world_size, port, checkpoint):
    from slime.backends.megatron_utils.hf_mapping import mapping_for
    from slime.backends.megatron_utils.names import named_global_buffers
    from tests.backends.megatron_utils.test_backend import ALGORITHM
    from tests.helpers.fsdp_helpers import make_train_data, make_trainer

    trainer = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, world_size=world_size), rank, world_size, port)
    trainer.train(0, make_train_data(8, vocab_size=300, seed=3, num_steps=2))
    mapping, hf_config = mapping_for(trainer.backend.hf_config), trainer.backend.hf_config
    biases = {hf: tensor.clone() for name, buffer in named_global_buffers(trainer.backend.model_chunks)
              for hf, tensor in mapping.to_hf(name, buffer, hf_config)}
    return biases, {name: tensor.cpu().clone() for name, tensor in trainer.backend.hf_weights(None)}
