"""The engine's GLM-4 (Glm4ForCausalLM: sandwich norms, interleaved half RoPE, q/k/v bias) and GLM-4.5
(Glm4MoeForCausalLM: half rotate-half RoPE, q/k/v bias without o bias, optional q/k norm, the biased sigmoid router
with group limits and routed scaling, an ungated shared expert, a leading dense layer) against transformers on tiny
checkpoints built here (fp32, init std 0.3 and random correction biases so a wrong piece shows): logits of a
prefill, a chunked prefill and paged decode (< 1e-4); greedy tokens and their log-probs through a prefix-cache hit;
routed experts in SGLang's layout equal to transformers' router for every MoE layer; MTP layer weights skipped; the
correction bias loaded, refused from a trainer push, and kept across a discarding release."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.engine.layers.grouped_router import choice_scores
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.sampling_params import SamplingParams
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model
from tests.engine.models.test_decoder import hf_logits, run_chunks
from tests.helpers.greedy_margin import assert_clear_greedy_margin

VARIANTS = {
    "glm4": dict(arch="glm4"),
    "glm4_moe": dict(arch="glm4_moe"),
    "glm4_moe_qk_norm": dict(arch="glm4_moe", use_qk_norm=True, norm_topk_prob=False),
    # 4 groups of 2 experts, 2 groups kept: the group limit changes picks on these weights
    "glm4_moe_groups": dict(arch="glm4_moe", n_group=4, topk_group=2, num_experts_per_tok=3),
}
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
ROUTER_MARGIN = 1e-4  # the k-th and (k+1)-th choice scores must differ by more than fp32 rounding


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), initializer_range=0.3, **VARIANTS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    moe = request.param != "glm4"
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=8,
                    enable_return_routed_experts=moe)
    return request.param, path, hf, engine


def test_config_variant_is_exercised(checkpoint):
    variant, _, hf, engine = checkpoint
    config = engine.model_config
    assert config.qkv_bias and not config.o_proj_bias
    assert config.rotary_dim == config.head_dim // 2
    assert config.rope_interleaved == config.sandwich_norms == (variant == "glm4")
    assert config.qk_norm == (variant == "glm4_moe_qk_norm")
    rotary = engine.model_runner.model.model.rotary
    assert rotary.cos.shape[1] == config.rotary_dim and rotary.interleaved == config.rope_interleaved
    if variant != "glm4":
        assert config.router == "sigmoid" and config.moe_layers == (1, 2) and config.routed_scaling_factor == 2.5
        assert config.shared_expert_intermediate_size == 32 and config.n_group == hf.config.n_group
        loaded = engine.model_runner.model.model.layers[1].mlp.gate.e_score_correction_bias
        expected = hf.model.layers[1].mlp.gate.e_score_correction_bias
        assert expected.abs().max() > 0 and torch.equal(loaded, expected)


def test_prefill_and_paged_decode_logits_match_transformers(checkpoint):
    _, _, hf, engine = checkpoint
    token_ids = [(7 * i + 3) % engine.model_config.vocab_size for i in range(30)]
    reference = hf_logits(hf, token_ids)
    assert reference.std() > 1.0  # logits spread: a wrong piece would show
    for chunks in ([30], [11, 9, 10], [13] + [1] * 17):  # prefill, chunked prefill, prefill + decode
        seq = Sequence("s", token_ids, SamplingParams(), seed=0)
        logits = run_chunks(engine, seq, chunks)
        assert (logits - reference).abs().max().item() < 1e-4, chunks


def test_greedy_tokens_and_log_probs_match_transformers_through_prefix_cache(checkpoint):
    _, _, hf, engine = checkpoint
    prompt = [10, 20, 30, 40, 50, 60, 70, 80, 90, 11]
    first, second = (engine.generate([prompt], GREEDY)[0] for _ in range(2))
    assert second["cached_tokens"] == 8 and first["cached_tokens"] == 0  # two full blocks from the prefix cache
    hf.generation_config.eos_token_id = None
    expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0)[0].tolist()
    assert_clear_greedy_margin(hf, prompt, expected[len(prompt):])
    log_probs = torch.log_softmax(hf_logits(hf, expected[:-1]), dim=-1)
    expected_log_probs = log_probs[len(prompt) - 1:].gather(1, torch.tensor(expected[len(prompt):])[:, None])[:, 0]
    for output in (first, second):
        assert output["output_ids"] == expected[len(prompt):]
        assert (torch.tensor(output["output_log_probs"]) - expected_log_probs).abs().max().item() < 1e-4
    assert len(set(expected[len(prompt):])) > 3


def hf_router_ids(hf, token_ids: list[int]) -> np.ndarray:
    """transformers' router ids [len(token_ids), num_hidden_layers, top_k] (sorted per row; dense layers zero), read
    from each MoE layer's gate; asserts no near-tie in the group ranking or the choice of experts."""
    config, captured = hf.config, {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, output, index=index: captured.__setitem__(index, output))
        for index, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        hf(torch.tensor([token_ids]))
    for hook in hooks:
        hook.remove()
    top_k, n_group, topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
    rows = np.zeros((len(token_ids), config.num_hidden_layers, top_k), dtype=np.int32)
    for index, (logits, _, ids) in captured.items():
        choice = torch.sigmoid(logits) + hf.model.layers[index].mlp.gate.e_score_correction_bias
        masked = choice_scores(torch.sigmoid(logits), hf.model.layers[index].mlp.gate.e_score_correction_bias,
                               n_group, topk_group)
        values = masked.topk(top_k + 1, dim=-1).values
        assert (values[:, top_k - 1] - values[:, top_k]).min() > ROUTER_MARGIN, "expert near-tie: change the prompt"
        if topk_group < n_group:
            groups = choice.view(len(token_ids), n_group, -1).topk(2, dim=-1).values.sum(-1).sort(-1, True).values
            assert (groups[:, topk_group - 1] - groups[:, topk_group]).min() > ROUTER_MARGIN, "group near-tie"
        rows[:, index] = ids.sort(dim=-1).values.numpy()
    return rows


def test_routed_experts_sglang_layout_equal_transformers_router(checkpoint):
    variant, _, hf, engine = checkpoint
    if variant == "glm4":
        pytest.skip("dense model: no routing")
    prompt = [(5 * i + 7) % 500 for i in range(13)]
    engine.generate([prompt], GREEDY)
    rid = engine.add_request(prompt, GREEDY, return_routed_experts=True)
    outputs = {}
    while rid not in outputs:
        outputs.update({output.rid: output for output in engine.step() if output.finished})
    output = outputs[rid]
    assert output.num_cached_tokens == 12  # the routing of prefix-cache hits comes back too
    tokens = prompt + output.output_token_ids
    routed = output.routed_experts
    config = hf.config
    assert routed.dtype == np.int32 and routed.shape == (len(tokens) - 1, config.num_hidden_layers,
                                                         config.num_experts_per_tok)
    assert not routed[:, 0].any()  # the leading dense layer's rows are zeros, as SGLang writes them
    np.testing.assert_array_equal(np.sort(routed, axis=-1), hf_router_ids(hf, tokens[:-1]))
    assert len(np.unique(routed[:, 1:])) > 4


def test_mtp_layer_weights_are_skipped_and_the_bias_is_required(tmp_path):
    path = build_tiny_model(tmp_path / "m", arch="glm4_moe", initializer_range=0.3)
    reference = Engine(str(path), device="cpu", num_kvcache_blocks=32).generate([[1, 2, 3, 4]], GREEDY)[0]
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
           "model.layers.3.mlp.gate.e_score_correction_bias": torch.randn(8)}
    save_file(mtp, str(path / "model-mtp.safetensors"))
    assert Engine(str(path), device="cpu", num_kvcache_blocks=32).generate([[1, 2, 3, 4]], GREEDY)[0]["output_ids"] \
        == reference["output_ids"]
    config["num_nextn_predict_layers"] = 0  # then the same tensors are unknown weights
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown weight 'model.layers.3"):
        Engine(str(path), device="cpu", num_kvcache_blocks=32)


def test_correction_bias_is_never_pushed_and_survives_a_discarding_release(checkpoint):
    variant, path, hf, engine = checkpoint
    if variant == "glm4":
        pytest.skip("dense model: no router")
    names = engine.named_weight_shapes()
    assert not any(name.endswith("e_score_correction_bias") for name in names)
    assert names["model.layers.1.mlp.gate.weight"][1] == torch.float32
    with pytest.raises(ValueError, match="unknown weight 'model.layers.1.mlp.gate.e_score_correction_bias'"):
        engine.load_weights([("model.layers.1.mlp.gate.e_score_correction_bias", torch.zeros(8))])
    bias = engine.model_runner.model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    engine.release_memory(discard_weights=True)
    engine.resume_memory()
    engine.load_weights([(name, tensor) for name, tensor in iterate_checkpoint(path)
                         if name in names])  # every weight a trainer sends: all but the bias
    assert not engine.weights_missing
    assert torch.equal(engine.model_runner.model.model.layers[1].mlp.gate.e_score_correction_bias, bias)
