"""The VL engine on CUDA (skipped without a GPU): Triton attention with CUDA-graph decode (positions shifted by
rope_delta) against transformers `generate` with images: the tiny Qwen2.5-VL / Qwen3-VL in fp32 (greedy tokens and
log-probs), and a Qwen2.5-VL-3B-shaped random model in bf16 (greedy tokens up to the first near-tie, log-probs within
bf16 tolerance)."""

import pytest
import torch

from slime.engine.engine import Engine
from slime.utils.image_policy import IMAGE_PLACEHOLDER, load_vl_processor
from slime.utils.tiny_vl_model import build_tiny_vl_model
from tests.helpers.vl_checkpoints import hf_log_probs, random_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TEXT = f"<|im_start|>user\n{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}: how many?<|im_end|>\n<|im_start|>assistant\n"
# Qwen2.5-VL-3B-Instruct's shape (config.json of the release), random weights
QWEN25_VL_3B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=128000,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
)


def _hf(path, dtype):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_generate(model, processor, images, max_new_tokens):
    encoded = processor.encode(TEXT, images)
    out = model.generate(input_ids=torch.tensor([encoded.input_ids]).cuda(),
                         mm_token_type_ids=torch.tensor([encoded.mm_token_type_ids]).cuda(),
                         pixel_values=encoded.pixel_values.cuda(), image_grid_thw=encoded.image_grid_thw.cuda(),
                         do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(encoded.input_ids):].tolist()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_tiny_vl_fp32_cuda_graphs_match_transformers_generate(arch, tmp_path):
    path = build_tiny_vl_model(tmp_path / arch, arch)
    processor = load_vl_processor(path)
    images = [random_image(61, 97, seed=1), random_image(150, 90, seed=2)]
    engine = Engine(str(path), device="cuda", dtype="float32", num_kvcache_blocks=256)
    assert engine.model_runner.use_triton and engine.model_runner.use_cuda_graphs
    ids = processor.tokenizer(TEXT)["input_ids"]
    rid = engine.add_request(ids, {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}, images=images)
    output = None
    while output is None:
        output = next((o for o in engine.step() if o.rid == rid and o.finished), None)
    assert engine.model_runner.decode_graphs is not None
    model = _hf(path, torch.float32)
    assert output.output_token_ids == _hf_generate(model, processor, images, 24)


def test_qwen25_vl_3b_shape_bf16_matches_transformers_generate(tmp_path):
    path = build_tiny_vl_model(tmp_path / "3b", "qwen2_5_vl", initializer_range=0.02, device="cuda",
                               dtype="bfloat16", **QWEN25_VL_3B)
    processor = load_vl_processor(path)
    images = [random_image(224, 300, seed=1), random_image(333, 217, seed=2)]
    engine = Engine(str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    ids = processor.tokenizer(TEXT)["input_ids"]
    rid = engine.add_request(ids, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}, images=images)
    output = None
    while output is None:
        output = next((o for o in engine.step() if o.rid == rid and o.finished), None)
    del engine
    torch.cuda.empty_cache()
    model = _hf(path, torch.bfloat16)
    expected = _hf_generate(model, processor, images, 16)
    # greedy tokens agree up to the first step whose top-2 logits are within bf16 rounding
    encoded = processor.encode(TEXT, images)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encoded.input_ids + expected]).cuda(),
                       mm_token_type_ids=torch.tensor([encoded.mm_token_type_ids + [0] * 16]).cuda(),
                       pixel_values=encoded.pixel_values.cuda(),
                       image_grid_thw=encoded.image_grid_thw.cuda()).logits[0, len(encoded.input_ids) - 1:-1].float()
    top2 = logits.topk(2, dim=-1).values
    clear = int((top2[:, 0] - top2[:, 1] < 0.05).float().argmax()) if (top2[:, 0] - top2[:, 1] < 0.05).any() else 16
    assert clear >= 2, "the random 3B model's first greedy steps are near-ties; change the image seeds"
    assert output.output_token_ids[:clear] == expected[:clear]
    got = torch.tensor(output.output_log_probs[:clear])
    want = hf_log_probs(model, processor, ids, images, output.output_token_ids[:clear]).float().cpu()
    assert (got - want).abs().max() < 0.1
