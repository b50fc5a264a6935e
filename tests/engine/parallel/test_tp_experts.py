"""The routed experts split over ranks, on one process (no collective runs inside GroupedExperts): for TP=2,
TP=2 x EP=2 and TP=4 x EP=2, the ranks' partial outputs, each rank holding its EP block's experts cut to its
intermediate slice (copied here by hand, not by the weight loader), sum to the unsharded experts' output, through
torch's grouped_mm (pairs of other ranks' experts riding in the last local group, then masked) and through the
per-expert fallback; on CUDA also in bf16 under the grouped_mm kernels."""

import pytest
import torch

from slime.engine.layers.moe import GroupedExperts, grouped_mm_available
from slime.engine.parallel.state import ParallelState

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 32, 16, 3


def shard_of(full: GroupedExperts, parallel: ParallelState) -> GroupedExperts:
    part = GroupedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, parallel).to(full.gate_up_proj)
    local, rows = part.num_local_experts, part.local_intermediate_size
    experts = slice(parallel.ep_rank * local, (parallel.ep_rank + 1) * local)
    inter = slice(parallel.moe_tp_rank * rows, (parallel.moe_tp_rank + 1) * rows)
    gate, up = full.gate_up_proj[experts].chunk(2, dim=1)
    with torch.no_grad():
        part.gate_up_proj.copy_(torch.cat([gate[:, inter], up[:, inter]], dim=1))
        part.down_proj.copy_(full.down_proj[experts][:, :, inter])
    return part


def check_shards_sum_to_full(device, dtype, use_grouped_mm, tp_size, ep_size, atol, rtol=0.0):
    generator = torch.Generator().manual_seed(0)
    full = GroupedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        full.gate_up_proj.normal_(generator=generator)
        full.down_proj.normal_(generator=generator)
    full = full.to(device=device, dtype=dtype)
    hidden = torch.randn(13, HIDDEN, generator=generator).to(device=device, dtype=dtype)
    expert_ids = torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K].repeat(13, 1)
    expert_ids = ((expert_ids + torch.arange(13)[:, None] * 5) % NUM_EXPERTS).to(device)  # distinct per token
    weights = torch.rand(13, TOP_K, generator=generator).to(device=device, dtype=dtype)
    full.use_grouped_mm = use_grouped_mm
    total = torch.zeros(13, HIDDEN, device=device, dtype=torch.float32)
    with torch.no_grad():
        expected = full(hidden, expert_ids, weights).float()
        for rank in range(tp_size):
            part = shard_of(full, ParallelState(rank, tp_size, ep_size))
            part.use_grouped_mm = use_grouped_mm
            total += part(hidden, expert_ids, weights).float()
    assert expected.abs().max() > 10  # the experts contribute: a dropped or doubled pair shows
    torch.testing.assert_close(total, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (2, 2), (4, 2)])
def test_expert_shards_sum_to_the_full_experts(use_grouped_mm, tp_size, ep_size):
    if use_grouped_mm and not grouped_mm_available():
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    check_shards_sum_to_full("cpu", torch.float32, use_grouped_mm, tp_size, ep_size, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (2, 2), (4, 2)])
def test_expert_shards_sum_to_the_full_experts_cuda_grouped_mm(tp_size, ep_size):
    from slime.engine.kernel_checks import grouped_mm_works

    device = torch.device("cuda")
    if not grouped_mm_works(device, torch.bfloat16):
        pytest.skip("grouped_mm does not run in bf16 on this GPU")
    # bf16 rounds each partial sum (outputs ~100): a dropped or doubled pair is off by tens
    check_shards_sum_to_full(device, torch.bfloat16, True, tp_size, ep_size, atol=1.0, rtol=2e-2)
