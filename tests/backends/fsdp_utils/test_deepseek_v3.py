"""The FSDP trainer on the DeepSeek-V3 family (transformers' DeepseekV3ForCausalLM / Glm4MoeLiteForCausalLM, packed
`slime_varlen` attention with a value head dim other than the query/key one, the re-bound grouped sigmoid router):
old-policy log-probs of a packed micro-batch equal transformers' per-sample forward (fp32, < 1e-5) for a V3-like
model (q_lora, YaRN, 4 groups / 2 kept), a Moonlight-like one, a kimi_k2 checkpoint (read as DeepseekV3Config) and
GLM-4.7-Flash's shape; a train step moves every MLA tensor. On a GPU (marked gpu) the same through FlashAttention's
varlen kernel in bf16."""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from slime.backends.packing import pack_samples
from tests.helpers.fsdp_helpers import capture_grads, make_args, make_train_data, make_trainer
from tests.helpers.mla_checkpoints import build_mla_checkpoint

SAMPLES = [[(7 * i + 3) % 300 for i in range(20)], [(11 * i + 2) % 300 for i in range(13)], [5, 9, 250, 4]]
RESPONSE_LENGTHS = [8, 5, 2]


def transformers_log_probs(hf, device="cpu"):
    pieces = []
    for tokens, response_length in zip(SAMPLES, RESPONSE_LENGTHS):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens], device=device)).logits[0].float()
        targets = torch.tensor(tokens[len(tokens) - response_length:], device=device)
        log_probs = torch.log_softmax(logits[len(tokens) - response_length - 1 : -1], -1)
        pieces.append(log_probs.gather(1, targets[:, None]).squeeze(1))
    return torch.cat(pieces)


@pytest.fixture
def process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["deepseek_v3", "moonlight", "kimi_k2", "glm4_moe_lite"])
def test_trainer_log_probs_equal_transformers(tmp_path, variant, process_group):
    path, hf_path = build_mla_checkpoint(tmp_path, variant)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_path), dtype=torch.float32).eval()
    expected = transformers_log_probs(hf)
    trainer = make_trainer(make_args(path))
    assert trainer.backend.routing_replay is not None  # the grouped sigmoid routers are re-bound
    with torch.no_grad():
        log_probs, _ = trainer.model.forward_micro_batch(pack_samples(SAMPLES, RESPONSE_LENGTHS, [0, 1, 2]))
    assert expected.std() > 0.5
    assert (log_probs - expected).abs().max().item() < 1e-5


def test_a_train_step_moves_every_mla_tensor(tmp_path, process_group):
    path, _ = build_mla_checkpoint(tmp_path, "deepseek_v3")
    trainer = make_trainer(make_args(path, "--lr", "1e-3"))
    grads = capture_grads(trainer)
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    attention = {name: grad for name, grad in grads[0].items() if ".layers.1.self_attn." in name}
    assert {name.split("self_attn.")[1] for name in attention} == {
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    assert all(grad.abs().sum() > 0 for grad in attention.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_on_flash_varlen_matches_transformers_bf16(tmp_path, process_group):
    """Mixed precision over FlashAttention's varlen kernel (V padded from 12 to 24 dims) against transformers' sdpa
    per sample in fp32."""
    path, _ = build_mla_checkpoint(tmp_path, "deepseek_v3", initializer_range=0.1)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    expected = transformers_log_probs(hf, "cuda")
    trainer = make_trainer(make_args(path, device="cuda"))
    with torch.no_grad():
        log_probs, _ = trainer.model.forward_micro_batch(pack_samples(SAMPLES, RESPONSE_LENGTHS, [0, 1, 2]))
    assert (log_probs.float() - expected).abs().mean().item() < 5e-2


def test_a_quantized_checkpoint_is_refused_with_the_conversion(tmp_path):
    from slime.backends.fsdp_utils.model import load_hf_model
    from tests.helpers.mla_checkpoints import rewrite_config

    path, _ = build_mla_checkpoint(tmp_path, "moonlight")
    rewrite_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="quant_method='fp8'.*tools/fp8_cast_bf16.py"):
        load_hf_model(str(path))
