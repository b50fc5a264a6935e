"""--moe-grouped-gemm on the Megatron backend's local spec (grouped_experts.py: stacked expert weights, torch's
grouped_mm) against megatron-core's SequentialMLP on the same tiny Qwen3-MoE, weights and packed micro-batches
(fp32, gloo): the same log-probs, loss and gradients of every weight at EP=1 and at EP=2 (two processes, each with
half the experts); the HF export of either equals the checkpoint bit for bit; torch_dist folders move between the
two layouts bit for bit, also from EP=2 to EP=1; the allgather token dispatcher gives alltoall's results; and the
dispatcher types and layouts that cannot work are refused at parse time."""

from __future__ import annotations

import pytest
import torch

from tests.backends.megatron_utils.test_parallel import _train_inputs
from tests.helpers.fsdp_helpers import run_distributed
from tests.helpers.megatron_helpers import (
    build_chunks,
    build_megatron,
    hf_named_grads,
    make_megatron_args,
    policy_loss_function,
    step_denominator,
)

pytest.importorskip("megatron.core")

NUM_EXPERTS = 4
RANK_MICRO_BATCHES = ([0, 1], [2, 3])  # at EP=2, data-parallel rank r runs these of the four micro-batches


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe_grouped"), arch="qwen3_moe", num_experts=NUM_EXPERTS,
                            num_experts_per_tok=2, seed=7, initializer_range=0.2)


def step(args, chunks, hf_config, micro_batches, everything, per_sample, device=torch.device("cpu")):
    """Log-probs, summed loss, full HF-named gradients and the distributed optimizer's gradient norm of one forward
    and backward over `micro_batches`."""
    from slime.backends.megatron_utils.grads import finalize_grads
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.optimizer import build_distributed_optimizer, clip_grad_norm, wrap_data_parallel

    ddp_chunks = wrap_data_parallel(chunks)
    optimizer, _ = build_distributed_optimizer(args, ddp_chunks, next(chunks[0].parameters()).dtype)
    common = dict(temperature=0.7, vocab_size=hf_config.vocab_size, device=device)
    log_probs = [lp for lp, _ in run_micro_batches(chunks, micro_batches, **common)]
    loss_fn = policy_loss_function(args, micro_batches, per_sample, step_denominator(args, everything, per_sample))
    metrics = run_micro_batches(chunks, micro_batches, loss_of=loss_fn, **common)
    finalize_grads(chunks, ddp_chunks)
    grads = hf_named_grads(chunks, hf_config)
    optimizer.prepare_grads()
    return dict(log_probs=log_probs, loss=float(sum(m["pg_loss"] for m in metrics)), grads=grads,
                grad_norm=clip_grad_norm(optimizer, 0.0))


def _perturb(chunks, seed: int) -> None:
    """Move every weight away from the checkpoint's, differently per weight and rank, so a checkpoint that loads
    the wrong expert or layer shows."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)


def _exported(chunks, hf_config) -> dict:
    from slime.backends.megatron_utils.hf_weights import model_hf_weights

    return {name: tensor.clone() for name, tensor in model_hf_weights(chunks, hf_config)}


def _no_tokens(experts) -> dict:
    """A rank's experts with no token routed to them (EP: every token went to other ranks' experts)."""
    hidden = torch.zeros(0, experts.config.hidden_size, requires_grad=True)
    output, _ = experts(hidden, torch.zeros(experts.num_local_experts, dtype=torch.long), torch.zeros(0))
    output.sum().backward()
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    result = dict(shape=tuple(output.shape), input_grad=hidden.grad is not None,
                  weight_grads=[float(weight.grad.abs().sum()) for weight in weights])
    for weight in weights:
        weight.grad = None
    return result


def _compare_layouts(rank, world_size, port, checkpoint, save_dir):
    from slime.backends.megatron_utils import checkpoint as torch_dist

    flags = ["--expert-model-parallel-size", world_size]
    sequential_args = make_megatron_args(checkpoint, *flags, world_size=world_size)
    grouped_args = make_megatron_args(checkpoint, *flags, "--moe-grouped-gemm", world_size=world_size)
    sequential, hf_config = build_megatron(sequential_args, rank, world_size, port)
    grouped = build_chunks(grouped_args, hf_config)
    everything, per_sample = _train_inputs(hf_config.vocab_size, seed=3, groups=([0, 1, 2], [3], [4], [5, 6, 7]))
    micro_batches = everything if world_size == 1 else [everything[i] for i in RANK_MICRO_BATCHES[rank]]
    result = dict(experts=type(grouped[0].decoder.layers[0].mlp.experts).__name__,
                  exported=_exported(grouped, hf_config), empty=_no_tokens(grouped[0].decoder.layers[0].mlp.experts))
    for name, args, chunks in (("sequential", sequential_args, sequential), ("grouped", grouped_args, grouped)):
        result[name] = step(args, chunks, hf_config, micro_batches, everything, per_sample)
    if world_size == 1:
        allgather_args = make_megatron_args(checkpoint, "--moe-grouped-gemm", "--moe-token-dispatcher-type",
                                            "allgather")
        allgather = build_chunks(allgather_args, hf_config)
        result["allgather_dispatcher"] = type(allgather[0].decoder.layers[0].mlp.token_dispatcher).__name__
        result["allgather"] = step(allgather_args, allgather, hf_config, micro_batches, everything, per_sample)
        # The EP=2 run's folders, resharded to EP=1, into both layouts.
        for folder in ("from_grouped", "from_sequential"):
            for name, chunks in (("sequential", sequential), ("grouped", grouped)):
                torch_dist.load_model_weights(save_dir / folder, chunks)
                result[f"{folder}_into_{name}"] = _exported(chunks, hf_config)
        return result
    # torch_dist across the layouts at EP=2: each saves its own perturbed weights, the other loads them.
    for seed, (folder, source, target) in enumerate((("from_grouped", grouped, sequential),
                                                     ("from_sequential", sequential, grouped))):
        _perturb(source, seed)
        torch_dist.save_weights(save_dir / folder, source, grouped_args, hf_config)
        result[f"{folder}_saved"] = _exported(source, hf_config)
        torch_dist.load_model_weights(save_dir / folder, target)
        result[f"{folder}_loaded"] = _exported(target, hf_config)
    return result


def _assert_same_step(mine: dict, reference: dict) -> None:
    for got, expected in zip(mine["log_probs"], reference["log_probs"], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=1e-7)
    assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert set(mine["grads"]) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(mine["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _assert_bit_equal(got: dict, expected: dict) -> None:
    assert got and set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_grouped_experts_equal_sequential_and_checkpoints_move_between_them(moe_checkpoint, tmp_path):
    from safetensors.torch import load_file

    on_disk = load_file(str(moe_checkpoint / "model.safetensors"))
    ep2 = run_distributed(_compare_layouts, 2, moe_checkpoint, tmp_path)
    ep1 = run_distributed(_compare_layouts, 1, moe_checkpoint, tmp_path)[0]

    assert ep1["experts"] == ep2[0]["experts"] == "GroupedExperts"
    for result in (ep1, *ep2):
        _assert_same_step(result["grouped"], result["sequential"])
        assert result["grouped"]["grad_norm"] == pytest.approx(ep1["sequential"]["grad_norm"], rel=1e-5)
        expert_grads = [grad for name, grad in result["grouped"]["grads"].items() if ".mlp.experts." in name]
        assert len(expert_grads) == 2 * 3 * NUM_EXPERTS // (1 if result is ep1 else 2)  # layers x projections
        assert all(grad.abs().max() > 0 for grad in expert_grads)
    # HF export of the grouped layout (rank 0 gathers the EP=2 experts): the checkpoint, bit for bit.
    _assert_bit_equal(ep1["exported"], on_disk)
    _assert_bit_equal(ep2[0]["exported"], on_disk)
    assert ep2[1]["exported"] == {}

    # No token for a rank's experts: an empty output whose backward reaches the (empty) tokens and the weights.
    for result in (ep1, *ep2):
        assert result["empty"] == dict(shape=(0, 64), input_grad=True, weight_grads=[0.0, 0.0])

    # The allgather dispatcher at EP=1 computes what alltoall computes.
    assert ep1["allgather_dispatcher"] == "MoEAllGatherTokenDispatcher"
    _assert_same_step(ep1["allgather"], ep1["grouped"])

    # torch_dist: saved by one layout at EP=2, loaded by the other at EP=2 and by both at EP=1, bit for bit.
    for folder in ("from_grouped", "from_sequential"):
        saved = ep2[0][f"{folder}_saved"]
        assert any(not torch.equal(saved[name], on_disk[name]) for name in on_disk)
        _assert_bit_equal(ep2[0][f"{folder}_loaded"], saved)
        for layout in ("sequential", "grouped"):
            _assert_bit_equal(ep1[f"{folder}_into_{layout}"], saved)


def test_dispatcher_types_that_cannot_run_are_refused(moe_checkpoint):
    from slime.config.errors import ArgumentError
    from slime.config.validate_megatron import require_train_backend

    with pytest.raises(ArgumentError, match="allgather gathers an equal number of tokens.*use "
                                            "--moe-token-dispatcher-type alltoall"):
        make_megatron_args(moe_checkpoint, "--moe-token-dispatcher-type", "allgather",
                           "--expert-model-parallel-size", "2", world_size=2)
    # flex: slime's large-MoE recipes pass it, so it parses; the start-up check refuses it
    args = make_megatron_args(moe_checkpoint, "--moe-token-dispatcher-type", "flex", world_size=2)
    with pytest.raises(ArgumentError, match="flex runs megatron-core's flex dispatcher on DeepEP.*use alltoall"):
        require_train_backend(args)


def test_dispatcher_layouts_that_can_run_parse(moe_checkpoint):
    make_megatron_args(moe_checkpoint, "--moe-token-dispatcher-type", "allgather", world_size=2)  # EP=1: DP peers
    make_megatron_args(moe_checkpoint, "--moe-token-dispatcher-type", "allgather", "--sequence-parallel",
                       "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", world_size=2, tp=2)
    # The FSDP backend runs transformers' experts: the Megatron dispatcher flags are no concern of its.
    from tests.helpers.fsdp_helpers import make_args

    make_args(moe_checkpoint, "--moe-token-dispatcher-type", "flex", world_size=2)


def test_grouped_experts_without_transformer_engine_need_whole_experts(moe_checkpoint):
    from slime.config.validate_megatron import unbuilt_megatron_features

    args = make_megatron_args(moe_checkpoint, "--moe-grouped-gemm", "--sequence-parallel", world_size=2, tp=2)
    assert args.expert_tensor_parallel_size == 2  # Megatron's default: the tensor-parallel size
    assert any("--expert-tensor-parallel-size 1" in line for line in unbuilt_megatron_features(args))
    args = make_megatron_args(moe_checkpoint, "--moe-grouped-gemm", "--sequence-parallel",
                              "--expert-tensor-parallel-size", "1", world_size=2, tp=2)
    assert not any("--moe-grouped-gemm" in line for line in unbuilt_megatron_features(args))
