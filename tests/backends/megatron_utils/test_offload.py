"""The Megatron trainer's colocated offload (megatron_utils/offload.py): storages leave and come back with every
view still valid; on a GPU, a train step after offload + onload gives bit for bit the parameters of one without, with
fp32 parameters (the optimizer's main weights are views of the parameter buffer) and with bf16 ones."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron_utils.offload import StorageOffload


def test_views_and_references_survive_an_offload():
    buffer = torch.arange(12, dtype=torch.float32)
    view = buffer[4:8]  # as the distributed optimizer's fp32 main weight is a slice of the parameter buffer
    state = torch.full((3,), 7.0)
    grads = torch.ones(5)
    offload = StorageOffload()
    for _ in range(2):  # the second round reuses the host copies
        offload.offload(keep=[view, buffer, state], drop=[grads])
        assert buffer.untyped_storage().nbytes() == 0 and state.untyped_storage().nbytes() == 0
        assert grads.untyped_storage().nbytes() == 0
        with pytest.raises(RuntimeError, match="already offloaded"):
            offload.offload(keep=[state])
        offload.onload()
        assert torch.equal(buffer, torch.arange(12, dtype=torch.float32))
        assert torch.equal(view, torch.tensor([4.0, 5.0, 6.0, 7.0]))
        assert torch.equal(state, torch.full((3,), 7.0)) and torch.equal(grads, torch.zeros(5))
        view.add_(100.0)  # the view still writes into the buffer
        assert buffer[4] == 104.0
        buffer[4:8] -= 100.0
        grads.fill_(1.0)


def test_a_storage_in_keep_and_drop_is_kept():
    shared = torch.tensor([1.0, 2.0])
    offload = StorageOffload()
    offload.offload(keep=[shared], drop=[shared[:1]])
    offload.onload()
    assert torch.equal(shared, torch.tensor([1.0, 2.0]))


def _two_steps(rank, world_size, port, checkpoint, bf16: bool, offload: bool):
    import torch.distributed as dist

    from slime.backends.megatron_utils.parallel import destroy_model_parallel
    from tests.helpers.fsdp_helpers import make_train_data, make_trainer
    from tests.helpers.megatron_helpers import make_megatron_args

    args = make_megatron_args(checkpoint, "--lr", "1e-3", "--micro-batch-size", "2", "--device", "cuda",
                              *(["--bf16"] if bf16 else []))
    trainer = make_trainer(args, port=port)
    data = make_train_data(8, vocab_size=300, seed=4, num_steps=2)
    trainer.train(0, data)
    freed = expected = 0
    if offload:
        backend = trainer.backend
        expected = sum(buffer.param_data.numel() * buffer.param_data.element_size() for buffer in backend._buffers())
        expected += sum(t.numel() * t.element_size() for t in backend._optimizer_tensors()
                        if t.untyped_storage().data_ptr() not in
                        {b.param_data.untyped_storage().data_ptr() for b in backend._buffers()})
        before = torch.cuda.memory_allocated()
        backend.offload()
        freed = before - torch.cuda.memory_allocated()
        backend.onload()
    trainer.train(1, data)
    params = {name: value.float().cpu() for name, value in trainer.backend.hf_weights(None)}
    destroy_model_parallel()
    dist.destroy_process_group()
    return params, freed, expected


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_train_after_offload_equals_train_without(tmp_path, bf16):
    pytest.importorskip("megatron.core")
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = build_tiny_model(tmp_path / "model", arch="qwen3", seed=2)
    plain, _, _ = run_distributed(_two_steps, 1, str(checkpoint), bf16, False)[0]
    offloaded, freed, expected = run_distributed(_two_steps, 1, str(checkpoint), bf16, True)[0]
    assert freed >= expected > 0
    assert plain.keys() == offloaded.keys()
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name
