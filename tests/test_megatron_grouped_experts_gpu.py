"""GPU check of the Megatron backend's grouped experts (--moe-grouped-gemm on the local spec: torch's bf16 grouped_mm
on CUDA) against megatron-core's SequentialMLP on the same weights and packed micro-batches: log-probs, loss and
every gradient agree to bf16 accuracy (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from fsdp_helpers import make_args, run_distributed
from megatron_helpers import build_chunks
from test_megatron_grouped_experts import step
from test_megatron_parallel import _train_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("megatron.core")


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def _compare_on_gpu(rank, world_size, port, checkpoint):
    from transformers import AutoConfig

    from slime.backends.fsdp_utils.backend import init_default_group
    from slime.backends.megatron_utils.parallel import init_model_parallel

    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    layouts = {"sequential": (), "grouped": ("--moe-grouped-gemm",)}
    args = {name: make_args(checkpoint, "--train-backend", "megatron", *flags, device="cuda", bf16=True)
            for name, flags in layouts.items()}
    init_default_group(cuda, rank, world_size, "127.0.0.1", port)
    init_model_parallel(args["sequential"], cuda)
    hf_config = AutoConfig.from_pretrained(checkpoint)
    micro_batches, per_sample = _train_inputs(hf_config.vocab_size, seed=1)
    per_sample = {key: [tensor.to(cuda) for tensor in tensors] for key, tensors in per_sample.items()}
    results = {}
    for name, layout_args in args.items():
        chunks = build_chunks(layout_args, hf_config, cuda)
        results[name] = step(layout_args, chunks, hf_config, micro_batches, micro_batches, per_sample, cuda)
        results[name]["experts"] = type(chunks[0].decoder.layers[0].mlp.experts).__name__
        results[name]["dtype"] = str(next(chunks[0].parameters()).dtype)
    grouped, sequential = results["grouped"], results["sequential"]
    return dict(
        experts=grouped["experts"], dtype=grouped["dtype"],
        log_prob_error=max(float((g - s).abs().max()) for g, s in zip(grouped["log_probs"], sequential["log_probs"])),
        loss=(grouped["loss"], sequential["loss"]), grad_norm=(grouped["grad_norm"], sequential["grad_norm"]),
        grad_errors={name: _relative_error(grouped["grads"][name], grad) for name, grad in sequential["grads"].items()},
    )


def test_grouped_experts_match_sequential_mlp_in_bf16_on_gpu(tmp_path):
    from slime.utils.tiny_model import build_tiny_model

    # grouped_mm's bf16 kernels want 16-byte rows: sizes as a real MoE's, 16 experts, top 4.
    checkpoint = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=16, num_experts_per_tok=4, seed=2,
                                  hidden_size=512, moe_intermediate_size=256, initializer_range=0.05)
    result = run_distributed(_compare_on_gpu, 1, checkpoint)[0]
    assert result["experts"] == "GroupedExperts" and result["dtype"] == "torch.bfloat16"
    assert result["log_prob_error"] < 5e-2
    grouped_loss, sequential_loss = result["loss"]
    assert grouped_loss == pytest.approx(sequential_loss, rel=2e-2, abs=1e-3)
    grouped_norm, sequential_norm = result["grad_norm"]
    assert grouped_norm == pytest.approx(sequential_norm, rel=2e-2)
    expert_errors = {name: error for name, error in result["grad_errors"].items() if ".mlp.experts." in name}
    assert len(expert_errors) == 2 * 3 * 16
    assert max(result["grad_errors"].values()) < 5e-2, result["grad_errors"]
