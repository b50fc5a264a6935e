"""slime's gradient clipping on local FSDP2 shards equals torch's `clip_grad_norm_`: the same total norm and the
same clipped gradients, for plain tensors and for sharded (DTensor) parameters, clipping or not."""

import math

import pytest
import torch
import torch.distributed as dist

from slime.backends.fsdp_utils.optimizer import clip_grad_norm
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_trainer


def _grads(params):
    return [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in params]


def _set_grads(params, seed):
    generator = torch.Generator().manual_seed(seed)
    for i, param in enumerate(params):
        values = torch.randn(param.shape, generator=generator) * (i + 1)
        if hasattr(param, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            values = distribute_tensor(values, param.device_mesh, param.placements)
        param.grad = values


@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])
def test_plain_tensors_match_torch(max_norm):
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(3, 4), (7,), (2, 2, 5)]]
    _set_grads(params, 0)
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    expected = _grads(params)
    _set_grads(params, 0)
    norm = clip_grad_norm(params, max_norm)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for got, want in zip(_grads(params), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_sharded_parameters_match_torch(tmp_path):
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=4)
    trainer = make_trainer(make_args(checkpoint), with_ref=False)
    try:
        params = list(trainer.model.parameters())
        assert all(hasattr(p, "device_mesh") for p in params)
        _set_grads(params, 1)
        unclipped = torch.sqrt(sum((g.double() ** 2).sum() for g in _grads(params)))
        expected_norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
        expected = _grads(params)
        _set_grads(params, 1)
        norm = clip_grad_norm(params, 0.1)
        assert float(norm) == pytest.approx(float(unclipped), rel=1e-6)
        assert float(norm) == pytest.approx(float(expected_norm.full_tensor()), rel=1e-6)
        for got, want in zip(_grads(params), expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        clipped_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in _grads(params)))
        assert float(clipped_norm) == pytest.approx(0.1, rel=1e-4)
    finally:
        dist.destroy_process_group()
