"""flat_buffer.flat_empty (one allocation per dtype, aligned, non-overlapping views) and the FSDP trainer's onload
into it (fsdp_utils/offload.place_parameters): the parameter shards swapped into flat views train exactly as the
separately allocated ones do (FSDP re-reads its shards after the swap, the optimizer steps the views)."""

import torch

from slime.backends.fsdp_utils.offload import local_tensor, place_parameters
from slime.utils.flat_buffer import ALIGNMENT_BYTES, flat_empty
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer


def test_flat_empty_gives_aligned_disjoint_views_of_one_allocation_per_dtype():
    specs = [((3, 5), torch.float32), ((), torch.float32), ((7,), torch.bfloat16), ((0, 4), torch.float32),
             ((130,), torch.bfloat16), ((2, 2), torch.float32)]
    views = flat_empty(specs, "cpu")
    assert [(tuple(v.shape), v.dtype) for v in views] == [(tuple(s), d) for s, d in specs]
    assert all(v.is_contiguous() for v in views)
    for dtype in (torch.float32, torch.bfloat16):
        group = [v for v in views if v.dtype == dtype]
        assert len({v.untyped_storage().data_ptr() for v in group}) == 1
        base = group[0].untyped_storage().data_ptr()
        assert all((v.data_ptr() - base) % ALIGNMENT_BYTES == 0 for v in group if v.numel())
    for index, view in enumerate(views):
        view.fill_(index + 1)
    assert all(torch.all(view == index + 1) for index, view in enumerate(views))  # no view overlaps another


def _params(trainer) -> dict[str, torch.Tensor]:
    return {name: local_tensor(param).detach().clone() for name, param in trainer.model.named_parameters()}


def test_parameters_placed_in_flat_views_train_like_separate_ones(tmp_path):
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=7)
    data = make_train_data(4, vocab_size=300, seed=2, num_steps=2)
    results = []
    for flat in (False, True):
        trainer = make_trainer(make_args(checkpoint, "--lr", "1e-3"))
        before = _params(trainer)
        if flat:
            place_parameters(trainer.model, torch.device("cpu"))
            shards = [local_tensor(param) for param in trainer.model.parameters()]
            assert len({shard.untyped_storage().data_ptr() for shard in shards}) == 1  # fp32: one allocation
            assert all(torch.equal(before[name], value) for name, value in _params(trainer).items())
        metrics = trainer.train(0, data)
        results.append((_params(trainer), metrics))
    (plain, plain_metrics), (flat, flat_metrics) = results
    assert any(not torch.equal(plain[name], before[name]) for name in plain)  # training moved them
    assert all(torch.equal(plain[name], flat[name]) for name in plain)
    losses = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("perf/")}
    assert losses(plain_metrics) == losses(flat_metrics) and losses(plain_metrics)
