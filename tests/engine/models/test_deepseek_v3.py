"""The engine's multi-head latent attention (DeepSeek-V3 family) against transformers on tiny checkpoints built
here: a V3-like model (q_lora_rank, DeepSeek-YaRN with both mscales, grouped router), a Moonlight-like one (q_lora
null, plain q_proj), the V3-like one under Kimi's `kimi_k2` model_type, and GLM-4.7-Flash's `glm4_moe_lite`.
Logits through prefill, chunked prefill and paged decode (fp32, < 1e-4); greedy tokens and log-probs through the
scheduler (8-token steps: chunked prefill), prefix-cache hits included; routed experts equal transformers' router; the latent cache's size per token (never expanded per head); a weight push
into kv_b_proj against a fresh engine on the new weights; MTP weights skipped; refusals named."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model
from tests.engine.models.test_glm import hf_router_ids
from tests.helpers.greedy_margin import assert_clear_greedy_margin
from tests.helpers.mla_checkpoints import build_mla_checkpoint, rewrite_config

VARIANTS = ["deepseek_v3", "moonlight", "kimi_k2", "glm4_moe_lite"]


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    """(variant, engine checkpoint, transformers model on the same weights, engine)."""
    variant = request.param
    path, hf_path = build_mla_checkpoint(tmp_path_factory.mktemp(variant), variant)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_path), dtype=torch.float32).eval()
    # 8 tokens per step: generate() runs every prompt as chunked prefill
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=8,
                    enable_return_routed_experts=True)
    return variant, path, hf, engine


def hf_logits(hf, token_ids):
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def run_chunks(engine, seq, chunk_sizes):
    logits = []
    for num_new_tokens in chunk_sizes:
        end = seq.num_computed_tokens + num_new_tokens
        engine.block_manager.grow(seq, end)
        logits.append(engine.model_runner.forward_logits([ScheduledSequence.of(seq, num_new_tokens)]))
        seq.num_computed_tokens = end
    engine.block_manager.free(seq)
    return torch.cat(logits)


def test_config_variant_is_exercised(checkpoint):
    variant, path, hf, engine = checkpoint
    mla = engine.model_config.mla
    assert engine.model_config.model_type == ("kimi_k2" if variant == "kimi_k2" else hf.config.model_type)
    assert (mla.q_lora_rank is None) == (variant == "moonlight")
    assert (mla.yarn is not None) == (variant in ("deepseek_v3", "kimi_k2"))
    assert mla.v_head_dim != mla.qk_head_dim
    assert engine.model_config.moe_layers == (1, 2) and engine.model_config.router == "sigmoid"
    assert (engine.model_config.n_group, engine.model_config.topk_group) == ((4, 2) if mla.yarn else (1, 1))
    layer = engine.model_runner.model.model.layers[0].self_attn
    assert hasattr(layer, "q_proj") == (variant == "moonlight")
    if mla.yarn is not None:  # both YaRN magnitudes differ from 1: the softmax scale's and the rope table's
        assert layer.attn.scale != mla.qk_head_dim**-0.5
        assert float(layer.rotary[0].cos[0, 0]) != 1.0


def test_prefill_and_paged_decode_logits_match_transformers(checkpoint):
    _, _, hf, engine = checkpoint
    token_ids = [(7 * i + 3) % engine.model_config.vocab_size for i in range(30)]
    reference = hf_logits(hf, token_ids)
    assert reference.std() > 1.0  # the weights spread the logits: a wrong computation shows
    for chunks in ([30], [11, 9, 10], [13] + [1] * 17):  # prefill, chunked prefill, prefill + decode
        seq = Sequence("s", token_ids, SamplingParams(), seed=0)
        logits = run_chunks(engine, seq, chunks)
        assert (logits - reference).abs().max().item() < 1e-4, chunks


def test_greedy_tokens_and_log_probs_match_transformers_with_prefix_cache_hits(checkpoint):
    _, _, hf, engine = checkpoint
    prompts = [[10, 20, 30, 40, 50, 60, 70, 80, 90], [9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 33]]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    hf.generation_config.eos_token_id = None
    engine.flush_cache()
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)  # the prompts' full blocks now come from the prefix cache
    for prompt, output, cached in zip(prompts, first, again):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0)
        expected = expected[0, len(prompt):].tolist()
        assert_clear_greedy_margin(hf, prompt, expected)
        assert output["output_ids"] == expected and cached["output_ids"] == expected
        assert cached["cached_tokens"] >= 8 and output["cached_tokens"] == 0
        logits = hf_logits(hf, prompt + expected)[len(prompt) - 1 : -1]
        hf_log_probs = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None]).squeeze(1)
        for log_probs in (output["output_log_probs"], cached["output_log_probs"]):
            assert (torch.tensor(log_probs) - hf_log_probs).abs().max().item() < 1e-4


def test_routed_experts_equal_transformers_router_in_every_moe_layer(checkpoint):
    """SGLang's layout (every hidden layer, the dense one zeros), the grouped router's ids equal transformers',
    prefix-cache hits included."""
    _, _, hf, engine = checkpoint
    prompt = [(5 * i + 7) % 500 for i in range(13)]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    engine.generate([prompt], params)
    rid = engine.add_request(prompt, params, return_routed_experts=True)
    outputs = {}
    while rid not in outputs:
        outputs.update({output.rid: output for output in engine.step() if output.finished})
    output = outputs[rid]
    assert output.num_cached_tokens == 12
    tokens = prompt + output.output_token_ids
    routed = output.routed_experts
    assert routed.shape == (len(tokens) - 1, hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
    assert not routed[:, 0].any()
    np.testing.assert_array_equal(np.sort(routed, axis=-1), hf_router_ids(hf, tokens[:-1]))


def test_latent_cache_holds_one_row_per_token_never_expanded(checkpoint):
    _, _, _, engine = checkpoint
    config, runner = engine.model_config, engine.model_runner
    mla = config.mla
    row = mla.kv_lora_rank + mla.qk_rope_head_dim
    # [layers, 1 plane, blocks + scratch, block_size, 1 latent head, kv_lora_rank + rope]
    assert tuple(runner.kv_cache.shape) == (config.num_hidden_layers, 1, 129, 4, 1, row)
    routing_bytes = len(config.moe_layers) * config.num_experts_per_tok * 4 * 4  # the routed-experts record
    assert runner.bytes_per_block - routing_bytes == config.num_hidden_layers * 4 * row * 4
    expanded = config.num_hidden_layers * 4 * config.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim) * 4
    assert runner.bytes_per_block - routing_bytes < expanded / 5  # 4 heads x (24 + 12 or 16) values vs one 24-row
    for attention in runner.model.attention_layers():
        assert attention.v_cache.data_ptr() == attention.k_cache.data_ptr()  # V is the latent's first columns


def test_named_weight_shapes_are_the_checkpoint_names(checkpoint):
    """Every checkpoint tensor but the router's correction-bias buffers, by name and shape (7 MLA weights per layer;
    Moonlight's plain q_proj replaces q_a_proj / q_a_layernorm / q_b_proj; attention_bias adds three biases)."""
    variant, path, _, engine = checkpoint
    engine_shapes = {name: shape for name, (shape, _) in engine.named_weight_shapes().items()}
    checkpoint_shapes = {name: tuple(tensor.shape) for name, tensor in iterate_checkpoint(path)
                         if not name.endswith("e_score_correction_bias")}
    assert engine_shapes == checkpoint_shapes
    attention = {name.split("self_attn.")[1] for name in engine_shapes if name.startswith("model.layers.0.self_attn.")}
    latent = {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    queries = {"q_proj.weight"} if variant == "moonlight" else {"q_a_proj.weight", "q_a_layernorm.weight",
                                                                 "q_b_proj.weight"}
    if engine.model_config.mla.attention_bias:  # glm4_moe_lite's tiny config: biases on the a-projections and o_proj
        latent, queries = latent | {"kv_a_proj_with_mqa.bias", "o_proj.bias"}, queries | {"q_a_proj.bias"}
    assert attention == latent | queries


@pytest.mark.parametrize("variant", ["deepseek_v3", "moonlight"])
def test_weight_push_into_kv_b_proj_equals_a_fresh_engine(tmp_path, variant):
    """The absorbed W_UK / W_UV are views of kv_b_proj.weight: a push of new kv_b_proj (and q / o) weights changes
    the output exactly as an engine started on a checkpoint holding them. (The expert-score bias is a buffer no
    trainer sends: both checkpoints share it.)"""
    path, _ = build_mla_checkpoint(tmp_path / "old", variant)
    new_path, _ = build_mla_checkpoint(tmp_path / "new", variant, seed=5, perturb_seed=0)
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64)
    fresh = Engine(str(new_path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64)
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    before = engine.generate([prompt], params)[0]
    pushed = [(name, tensor) for name, tensor in iterate_checkpoint(new_path) if ".self_attn." in name]
    assert any("kv_b_proj" in name for name, _ in pushed)
    engine.update_weights_from_tensors(pushed)
    only_attention = engine.generate([prompt], params)[0]
    engine.update_weights_from_tensors([(name, tensor) for name, tensor in iterate_checkpoint(new_path)
                                        if not name.endswith("e_score_correction_bias")])
    after, expected = engine.generate([prompt], params)[0], fresh.generate([prompt], params)[0]
    assert only_attention["output_log_probs"] != before["output_log_probs"]
    assert after["output_ids"] == expected["output_ids"]
    assert after["output_log_probs"] == expected["output_log_probs"]  # bit-identical: same weights, same path


def test_mtp_layer_weights_are_skipped(tmp_path):
    """A released checkpoint's multi-token-prediction layer (model.layers.{num_hidden_layers}.*) loads as nothing."""
    path, _ = build_mla_checkpoint(tmp_path / "ckpt", "deepseek_v3")
    reference = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=32)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    for name in [name for name in weights if name.startswith("model.layers.0.")]:
        weights[name.replace("model.layers.0.", f"model.layers.{num_layers}.")] = weights[name] + 1
    weights[f"model.layers.{num_layers}.eh_proj.weight"] = torch.ones(64, 128)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    rewrite_config(path, num_nextn_predict_layers=1)
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=32)
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    assert engine.generate([[5, 6, 7]], params)[0]["output_log_probs"] == \
        reference.generate([[5, 6, 7]], params)[0]["output_log_probs"]
    rewrite_config(path, num_nextn_predict_layers=0)  # without MTP in the config, the extra layer is an error
    with pytest.raises(ValueError, match=f"unknown weight 'model.layers.{num_layers}"):
        Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=32)


def test_refusals_name_the_setting(tmp_path):
    path, _ = build_mla_checkpoint(tmp_path / "ckpt", "moonlight")
    with pytest.raises(ValueError, match="tp_size=2.*--tp-size.*multi-head latent attention"):
        Engine(str(path), device="cpu", tp_size=2, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3'.*latent KV cache.*'auto'"):
        Engine(str(path), device="cpu", kv_cache_dtype="fp8_e4m3", num_kvcache_blocks=8)
    rewrite_config(path, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope type 'llama3' for multi-head latent attention"):
        Engine(str(path), device="cpu")


def test_kimi_k2_config_is_deepseek_v3_under_another_name(tmp_path):
    """Kimi's config.json: architectures DeepseekV3ForCausalLM, model_type kimi_k2; a kimi_k2 type under another
    architecture is refused."""
    path = build_tiny_model(tmp_path / "kimi", arch="deepseek_v3", num_hidden_layers=1, first_k_dense_replace=1)
    shutil.copy(path / "config.json", tmp_path / "config.bak")
    rewrite_config(path, model_type="kimi_k2")
    assert Engine(str(path), device="cpu", num_kvcache_blocks=8).model_config.mla.kv_lora_rank == 16
    rewrite_config(path, architectures=["KimiK2ForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architectures"):
        Engine(str(path), device="cpu")


def quantize_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block) as DeepSeek's checkpoints store them: each block's
    amax maps to fp8's largest value."""
    rows, columns = weight.shape
    row_blocks, column_blocks = -(-rows // block), -(-columns // block)
    padded = torch.zeros(row_blocks * block, column_blocks * block)
    padded[:rows, :columns] = weight
    tiles = padded.view(row_blocks, block, column_blocks, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    quantized = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :columns].to(torch.float8_e4m3fn)
    return quantized, scale


def test_block_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    """A block-FP8 checkpoint (weights in float8_e4m3fn with weight_scale_inv, 16 x 16 blocks, partial blocks at the
    edges) gives exactly the outputs of an fp32 checkpoint holding fp8 value x block scale."""
    from safetensors.torch import load_file, save_file

    path, _ = build_mla_checkpoint(tmp_path / "fp8", "deepseek_v3")
    dequantized_path = tmp_path / "dequantized"
    shutil.copytree(path, dequantized_path)
    weights = load_file(str(path / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, tensor in weights.items():
        if name.endswith("_proj.weight") and ".layers." in name:  # the projections DeepSeek quantizes
            quantized, scale = quantize_blocks(tensor, 16)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = quantized, scale
            block_scales = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
            dequantized[name] = quantized.float() * block_scales[: tensor.shape[0], : tensor.shape[1]]
        else:
            fp8[name] = dequantized[name] = tensor
    assert sum(tensor.dtype == torch.float8_e4m3fn for tensor in fp8.values()) >= 8
    save_file(fp8, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_path / "model.safetensors"), metadata={"format": "pt"})
    rewrite_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [16, 16]})
    params = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    outputs = [Engine(str(p), device="cpu", num_kvcache_blocks=32).generate([[4, 8, 15, 16, 23, 42]], params)[0]
               for p in (path, dequantized_path)]
    assert outputs[0]["output_ids"] == outputs[1]["output_ids"]
    assert outputs[0]["output_log_probs"] == outputs[1]["output_log_probs"]
    rewrite_config(path, quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"})
    with pytest.raises(ValueError, match="quant_method='compressed-tensors'.*tools/fp8_cast_bf16.py"):
        Engine(str(path), device="cpu")


def test_release_and_resume_of_the_latent_cache_and_weights(tmp_path):
    """A colocated hand-over frees the latent cache and the weights; after resume (and after a discarding release
    refilled by a full push) the engine generates exactly what it did before."""
    path, _ = build_mla_checkpoint(tmp_path, "moonlight")
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=32)
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    before = engine.generate([prompt], params)[0]
    engine.release_memory()
    assert not engine.model_runner.has_kv_cache
    engine.resume_memory()
    assert engine.generate([prompt], params)[0]["output_log_probs"] == before["output_log_probs"]
    engine.release_memory(discard_weights=True)
    engine.resume_memory()
    engine.update_weights_from_tensors([(name, tensor) for name, tensor in iterate_checkpoint(path)
                                        if not name.endswith("e_score_correction_bias")])
    assert engine.generate([prompt], params)[0]["output_log_probs"] == before["output_log_probs"]
