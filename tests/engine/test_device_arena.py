"""engine/device_arena.py: device memory that comes back at the same addresses after it is freed.

On the CPU: StableBuffers' layout (flat_buffer.flat_layout: aligned, disjoint views of mixed dtypes) and its
fallback to ordinary allocations (`stable` False: a CPU has no arena). On CUDA (marked, skipped without a GPU): the
arena maps, unmaps and maps again at the same address, the unmapped memory goes back to the device, and a CUDA graph
captured on arena memory reads what is there after a remap (what keeps the engine's decode graphs valid across a
colocated release)."""

from __future__ import annotations

import gc

import pytest
import torch

from slime.engine.device_arena import DeviceArena, StableBuffers, arena_supported
from slime.utils.flat_buffer import ALIGNMENT_BYTES, flat_layout

SPECS = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((0, 4), torch.float32), ((130,), torch.int32),
         ((2, 2), torch.float8_e4m3fn), ((1,), torch.float64)]


def cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def test_flat_layout_aligns_every_tensor_and_counts_padded_bytes():
    offsets, num_bytes = flat_layout(SPECS)
    # 60 B, 14 B, 0 B, 520 B, 4 B, 8 B: each padded to a multiple of 512
    assert offsets == [0, 512, 1024, 1024, 2048, 2560]
    assert num_bytes == 3072 and all(offset % ALIGNMENT_BYTES == 0 for offset in offsets)


def _check_views(views) -> None:
    assert [(tuple(v.shape), v.dtype) for v in views] == [(tuple(s), d) for s, d in SPECS]
    for index, view in enumerate(views):
        view.view(torch.uint8).fill_(index + 1)
    for index, view in enumerate(views):  # no view overlaps another
        assert torch.all(view.view(torch.uint8) == index + 1)


def test_stable_buffers_fall_back_to_ordinary_allocations_on_the_cpu():
    buffers = StableBuffers(torch.device("cpu"), SPECS)
    assert not buffers.stable and not arena_supported(torch.device("cpu"))
    _check_views(buffers.allocate())
    buffers.free()  # nothing to give back: the views own their memory
    _check_views(buffers.allocate())


@cuda
def test_arena_comes_back_at_the_same_address_and_returns_its_memory():
    device = torch.device("cuda", torch.cuda.current_device())
    assert arena_supported(device)
    num_bytes = 1 << 30
    arena = DeviceArena(device, num_bytes)
    first = arena.map()
    first.fill_(7)
    address = first.data_ptr()
    assert address == arena.address and first.numel() == arena.num_bytes >= num_bytes
    del first
    free_mapped = torch.cuda.mem_get_info(device)[0]
    arena.unmap()
    assert torch.cuda.mem_get_info(device)[0] - free_mapped >= num_bytes  # the physical memory went back
    again = arena.map()
    assert again.data_ptr() == address
    again.fill_(3)
    assert int(again[-1]) == 3
    del again
    arena.close()


@cuda
def test_stable_buffers_views_keep_their_addresses_across_free():
    buffers = StableBuffers(torch.device("cuda", torch.cuda.current_device()), SPECS)
    assert buffers.stable
    views = buffers.allocate()
    _check_views(views)
    addresses = [v.data_ptr() for v in views]
    del views
    buffers.free()
    views = buffers.allocate()
    assert [v.data_ptr() for v in views] == addresses
    _check_views(views)


@cuda
def test_a_cuda_graph_on_arena_memory_reads_it_after_a_remap():
    device = torch.device("cuda", torch.cuda.current_device())
    buffers = StableBuffers(device, [((1024,), torch.float32), ((1024,), torch.float32)])
    source, target = buffers.allocate()
    source.fill_(1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        target.copy_(source * 2)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        target.copy_(source * 2)
    del source, target
    buffers.free()
    source, target = buffers.allocate()  # fresh physical memory, same addresses
    source.copy_(torch.arange(1024, dtype=torch.float32, device=device))
    graph.replay()
    torch.testing.assert_close(target, 2 * torch.arange(1024, dtype=torch.float32, device=device))


@cuda
def test_an_arena_nothing_references_gives_its_memory_back():
    device = torch.device("cuda", torch.cuda.current_device())
    num_bytes, margin = 1 << 30, 64 << 20
    gc.collect()  # memory earlier tests drop must not come back while this one measures
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    arena = DeviceArena(device, num_bytes)
    view = arena.map()
    del arena
    gc.collect()
    assert torch.cuda.mem_get_info(device)[0] <= free_before - num_bytes  # the view keeps the arena mapped
    view.fill_(1)
    torch.cuda.synchronize(device)
    del view
    gc.collect()
    assert torch.cuda.mem_get_info(device)[0] >= free_before - margin


class _RefusingLibrary:
    """Stands in for libcuda where none is loaded (this CPU): every call answers `result`, and the error string
    call fills in a message, as the driver does."""

    def __init__(self, result: int):
        self.result = result

    def __getattr__(self, name):
        if name == "cuGetErrorString":
            def error_string(result, message_pointer):
                message_pointer._obj.value = b"refused"
                return 0
            return error_string
        return lambda *args: self.result


def test_driver_errors_name_the_call_and_out_of_memory_is_torchs_error():
    from slime.engine import device_arena

    driver = device_arena._Driver.__new__(device_arena._Driver)
    driver.lib = _RefusingLibrary(2)
    with pytest.raises(torch.OutOfMemoryError, match="cuMemCreate failed: CUresult 2 .*gpu_memory_utilization"):
        driver("cuMemCreate")
    driver.lib = _RefusingLibrary(1)
    with pytest.raises(device_arena.DriverError, match=r"cuMemMap failed: CUresult 1 \(refused\)"):
        driver("cuMemMap")
