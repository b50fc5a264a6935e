"""GPU-only checks of LoRA on the FSDP trainer (skipped without CUDA): bf16 mixed-precision steps train the
adapters only, the frozen base stays bitwise, an offload releases every parameter and the adapter-sized optimizer
state, and the onloaded model gives the log-probs it gave before the offload.
Run: `pytest -m gpu tests/backends/fsdp_utils/test_lora_gpu.py`."""

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_lora_train_offload_onload(tmp_path):
    from torch.distributed.tensor import DTensor

    from slime.backends.lora_adapter import is_lora_name
    from slime.backends.packing import pack_samples
    from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer
    from tests.helpers.lora_helpers import LORA_FLAGS, wide_tiny_checkpoint

    checkpoint = wide_tiny_checkpoint(tmp_path / "tiny")
    args = make_args(checkpoint, *LORA_FLAGS, "--lr", "1e-2", "--micro-batch-size", "2", "--use-kl-loss",
                     "--kl-loss-coef", "0.1", device="cuda")
    trainer = make_trainer(args, with_ref=True)
    data = make_train_data(8, vocab_size=300, seed=2, num_steps=2)
    before = full_params(trainer)
    trainer.train(0, data)
    after = full_params(trainer)
    for name, value in before.items():
        assert torch.equal(after[name], value) != is_lora_name(name), name
    optimizer = trainer.backend._optimizer
    lora = {id(p) for name, p in trainer.model.named_parameters() if is_lora_name(name)}
    assert {id(p) for p in optimizer.state} == lora
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(8)))
    expected, _ = trainer.backend.forward_only([packed])[0]
    trainer.offload()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    assert all(t.untyped_storage().nbytes() == 0 for t in local if t.is_cuda)
    trainer.onload()
    got, _ = trainer.backend.forward_only([packed])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    dist.destroy_process_group()


def test_gpu_several_adapters_bf16_steps_move_each_adapter_by_its_own_samples(tmp_path):
    """--lora-adapter-names under bf16 mixed precision: a step on one adapter's samples moves that adapter only, and
    the per-token masks keep the compute dtype (the forward runs)."""
    from slime.backends.lora_adapter import is_lora_name
    from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer
    from tests.helpers.lora_helpers import LORA_FLAGS, wide_tiny_checkpoint

    checkpoint = wide_tiny_checkpoint(tmp_path / "tiny")
    args = make_args(checkpoint, *LORA_FLAGS, "--lora-adapter-key", "task", "--lora-adapter-names", "a,b",
                     "--lr", "1e-2", "--micro-batch-size", "2", device="cuda")
    trainer = make_trainer(args)
    data = {**make_train_data(8, vocab_size=300, seed=2, num_steps=2), "lora_adapters": [1] * 8}
    before = full_params(trainer)
    trainer.train(0, data)
    after = full_params(trainer)
    for name, value in before.items():
        assert torch.equal(after[name], value) != (is_lora_name(name) and ".b." in name), name
    dist.destroy_process_group()
