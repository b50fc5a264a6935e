"""Megatron's context-parallel layout of a packed row, without processes: every token of the padded row lives on
exactly one CP rank, rank r holds chunks r and 2 x CP - 1 - r of each sample, the K/V gather's index rebuilds the
row from the ranks' tokens, and each response position's predictor is found on exactly one rank (the numerics over
gloo are test_megatron_parallel.py's)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("cp_size", [2, 3])
def test_layout_splits_each_sample_into_mirrored_chunks(cp_size):
    from slime.backends.megatron_utils.context_parallel import CpLayout

    split = 2 * cp_size
    lengths = [split, 3 * split, 2 * split]
    row = torch.arange(sum(lengths)) + 100
    layouts = [CpLayout.of(lengths, cp_size, rank) for rank in range(cp_size)]
    assert sorted(torch.cat([layout.local_index for layout in layouts]).tolist()) == list(range(sum(lengths)))
    start = 0
    for length in lengths:
        chunk = length // split
        for rank, layout in enumerate(layouts):
            mine = set(layout.local_index.tolist())
            for j in range(split):
                owned = all(start + j * chunk + i in mine for i in range(chunk))
                assert owned == (j in (rank, split - 1 - rank)), (length, rank, j)
        start += length
    every_rank = torch.cat([row[layout.local_index] for layout in layouts])  # what the all-gather returns
    for layout in layouts:
        assert torch.equal(every_rank[layout.gather_index], row)
    with pytest.raises(ValueError, match="multiples of 2 x context-parallel size"):
        CpLayout.of([split + 1], cp_size, 0)


def test_each_response_position_is_held_by_one_rank_with_its_token():
    from slime.backends.megatron_utils.micro_batches import context_parallel_thd_input
    from slime.backends.packing import pack_samples

    tokens = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]
    micro_batch = pack_samples(tokens, [2, 4, 1], [0, 1, 2])
    predictors = micro_batch.input_ids[0][micro_batch.logit_index]
    held_by = torch.zeros(len(predictors), dtype=torch.long)
    for rank in range(2):
        inputs, rows = context_parallel_thd_input(micro_batch, torch.device("cpu"), 2, 2, rank)
        assert inputs.input_ids.shape[1] * 2 == int(inputs.packed_seq_params.cu_seqlens_q[-1])
        assert (inputs.packed_seq_params.cu_seqlens_q.diff() % 4 == 0).all()  # padded to 2 x CP, row to x TP 2
        assert int(inputs.packed_seq_params.cu_seqlens_q[-1]) % 8 == 0
        assert torch.equal(inputs.input_ids[0][rows.local_rows], predictors[rows.held])
        held_by += rows.held.long()
    assert (held_by == 1).all()
