"""GPU-only checks of the FSDP trainer on vision-language models (skipped without CUDA): bf16 mixed precision with
FlashAttention varlen over packed VL rows (pixel values cast to the compute dtype by FSDP) against transformers'
fp32 forward of each sample alone, and a train step with the vision tower frozen and trained."""

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_gpu_packed_vl_log_probs_and_steps(tmp_path, arch):
    from slime.backends.packing import pack_samples
    from slime.utils.tiny_vl_model import build_tiny_vl_model
    from tests.backends.fsdp_utils.test_vision_language import reference_log_probs, vl_train_data
    from tests.helpers.fsdp_helpers import make_args, make_trainer

    checkpoint = build_tiny_vl_model(tmp_path / arch, arch=arch, seed=1, initializer_range=0.5)
    data = vl_train_data(checkpoint)
    expected = reference_log_probs(checkpoint, data)
    trainer = make_trainer(make_args(checkpoint, "--lr", "1e-2", "--micro-batch-size", "3",
                                     "--freeze-params-name-list", "visual", device="cuda"))
    try:
        packed = pack_samples(data["tokens"], data["response_lengths"], [0, 1, 2], data["multimodal_train_inputs"])
        with torch.no_grad():
            log_probs, _ = trainer.model.forward_micro_batch(packed.to(trainer.device))
        for actual, reference in zip(log_probs.float().cpu().split(data["response_lengths"]), expected):
            # bf16 compute against an fp32 reference: agreement to bf16's precision over a 2-layer model
            torch.testing.assert_close(actual, reference, rtol=0, atol=0.15)
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        metrics = trainer.train(0, data)
        assert torch.isfinite(torch.tensor(metrics["train/loss"])) and metrics["train/grad_norm"] > 0
        changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p.detach())}
        assert changed and not any(".visual." in name for name in changed)
    finally:
        dist.destroy_process_group()
