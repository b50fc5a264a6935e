"""Micro-batch schedule of the FSDP trainer: steps, static and token-budget bins, equalised bin counts."""

import pytest

from slime.backends.packing import pad_num_micro_batches, split_micro_batches, step_sample_indices
from slime.backends.push_pipeline import iter_buckets


def test_step_sample_indices():
    assert step_sample_indices(6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="optimizer steps"):
        step_sample_indices(5, 2)


def test_static_and_dynamic_micro_batches():
    lengths = [5, 9, 3, 7, 2]
    assert split_micro_batches([0, 1, 2, 3, 4], lengths, 2) == [[0, 1], [2, 3], [4]]
    bins = split_micro_batches([0, 1, 2, 3, 4], lengths, 1, max_tokens=10)
    assert bins == [[0, 2, 4], [1], [3]]
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert split_micro_batches([0, 1], [30, 4], 1, max_tokens=10) == [[0], [1]]  # oversized sample alone


def test_pad_num_micro_batches_splits_largest_bins_and_keeps_every_sample():
    lengths = [5, 9, 3, 7, 2, 4]
    padded = pad_num_micro_batches([[0, 1, 2], [3, 4, 5]], lengths, 4)
    assert len(padded) == 4
    assert sorted(i for b in padded for i in b) == list(range(6))
    assert padded[:2] == [[0], [1, 2]]  # the 17-token bin was split first


def test_iter_buckets_respects_budget_and_marks_last():
    import torch

    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([4, 4, 10, 1, 1])]  # fp32: 4 bytes each
    buckets = list(iter_buckets(tensors, bucket_bytes=32))
    assert [[name for name, _ in b] for b, _ in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    assert [last for _, last in buckets] == [False, False, True]
    assert list(iter_buckets([], 32)) == []
