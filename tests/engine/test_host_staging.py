"""HostStaging: step inputs reach the device intact (dtypes, shapes, empty arrays, strided destinations), and on
CUDA a copy is queued behind running GPU work instead of waiting for it, while reused pinned buffers are never
overwritten before their copy has run."""

import numpy as np
import pytest
import torch

from slime.engine.host_staging import NUM_SLOTS, HostStaging

cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def arrays():
    rng = np.random.default_rng(0)
    return [rng.integers(-2**40, 2**40, size=37), rng.random((3, 5)).astype(np.float32),
            rng.integers(0, 9, size=(4, 6)).astype(np.int32), np.zeros(0, dtype=np.int64)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_contents_dtypes_and_shapes(device):
    staging = HostStaging(torch.device(device))
    for array in arrays():
        tensor = staging.to_device(array)
        assert tensor.device.type == device and tensor.shape == array.shape
        np.testing.assert_array_equal(tensor.cpu().numpy(), array)
    destination = torch.zeros(4, 10, dtype=torch.int32, device=device)
    staging.copy_(destination[:, 2:8], arrays()[2])
    np.testing.assert_array_equal(destination[:, 2:8].cpu().numpy(), arrays()[2])
    assert not destination[:, :2].any() and not destination[:, 8:].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_queue_behind_gpu_work_and_slots_are_reused_safely():
    staging = HostStaging(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    first = staging.to_device(np.arange(1000, dtype=np.int64))
    assert not torch.cuda.current_stream().query(), "the copy waited for the GPU work queued before it"
    # Three times round the ring: a slot is refilled only once the copy that read it has run.
    results = [staging.to_device(np.full(257, i, dtype=np.int64)) for i in range(3 * NUM_SLOTS)]
    torch.cuda.synchronize()
    assert torch.equal(first.cpu(), torch.arange(1000))
    for i, tensor in enumerate(results):
        assert torch.equal(tensor.cpu(), torch.full((257,), i)), i
