"""Routing replay on the Megatron backend, on test_routing_replay.py's near-tie Qwen3-MoE (the engine serves the
checkpoint whose experts 0 and 1 route by r + d / r - d, the trainer trains the one with -d): with R3
(--use-rollout-routing-replay) megatron-core's routers hand the engine's experts to the token dispatcher exactly
and the old log-probs match the rollout's, with SequentialMLP experts and with --moe-grouped-gemm's; routing freely
they do not. --use-routing-replay trains on the
old-policy pass's routing even after the router changed, also in the backward's recompute. Over two pipeline
stages each stage replays its own layers and the router agreement counts every layer; under TP=2 with sequence
parallelism and EP=2 each tensor-parallel rank replays its slice of the row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.backends.test_routing_replay import checkpoints, rollout  # noqa: F401 - the module-scoped fixtures
from tests.helpers.fsdp_helpers import make_trainer, run_distributed
from tests.helpers.megatron_helpers import build_megatron, make_megatron_args

pytest.importorskip("megatron.core")


def _routers(trainer):
    return [layer.mlp.router for chunk in trainer.backend.model_chunks for layer in chunk.decoder.layers]


def _capture_routing_maps(trainer) -> list[torch.Tensor]:
    """The [tokens, experts] routing map each router hands to the token dispatcher, in forward order."""
    received = []
    for router in _routers(trainer):
        router.register_forward_hook(lambda _module, _inputs, output: received.append(output[1].clone()))
    return received


def _prepare(rank, world_size, port, checkpoint, data, parallel, *flags):
    """Old and reference log-probs, the preparation metrics, the routing maps of the old-policy pass and the
    routing its micro-batches carry into training."""
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    args = make_megatron_args(checkpoint, "--get-mismatch-metrics", "--micro-batch-size", "2", "--use-kl-loss",
                              "--ref-load", checkpoint, *flags, world_size=world_size, **parallel)
    trainer = make_trainer(args, rank, world_size, port, with_ref=True)
    received = _capture_routing_maps(trainer)
    schedule, per_sample, metrics = trainer._prepare(data)
    destroy_model_parallel()
    torch.distributed.destroy_process_group()
    carried = [micro_batch.routed_experts for step in schedule for micro_batch in step]
    return per_sample["old_log_probs"], per_sample["ref_log_probs"], metrics, received[len(received) // 2:], carried


def _free_and_replayed(rank, world_size, port, checkpoint, data, parallel, with_record=False, flags=()):
    free = _prepare(rank, world_size, port, checkpoint, data, parallel, *flags)
    replayed = _prepare(rank, world_size, port + 1, checkpoint, data, parallel, "--use-rollout-routing-replay",
                        *flags)
    if not with_record:
        return free, replayed
    return free, replayed, _prepare(rank, world_size, port + 2, checkpoint, data, parallel, "--use-routing-replay",
                                    *flags)


def _max_mismatch(old_log_probs, data) -> float:
    return max(float((old - torch.tensor(rollout)).abs().max())
               for old, rollout in zip(old_log_probs, data["rollout_log_probs"]))


def _engine_maps(data, num_experts: int) -> list[list[np.ndarray]]:
    """Per micro-batch ([0, 1] and [2, 3]) and MoE layer, the engine's routing as a [tokens - 1 per sample,
    experts] map, and the packed rows of the samples' last tokens (which the engine never routed)."""
    maps, last_rows = [], []
    for batch in ([0, 1], [2, 3]):
        ids = np.concatenate([data["rollout_routed_experts"][i] for i in batch])
        routing_map = np.zeros((ids.shape[0], ids.shape[1], num_experts), dtype=bool)
        np.put_along_axis(routing_map, ids.astype(np.int64), True, axis=2)
        maps.append([routing_map[:, layer] for layer in range(ids.shape[1])])
        last_rows.append(np.cumsum([len(data["tokens"][i]) for i in batch]) - 1)
    return maps, last_rows


def _assert_engine_routing(received: list[torch.Tensor], data, layers: list[int]) -> None:
    """`received`: a stage's routing maps, micro-batch by micro-batch, its MoE layers `layers` in each."""
    maps, last_rows = _engine_maps(data, received[0].shape[1])
    for index, routing_map in enumerate(received):
        batch, position = divmod(index, len(layers))
        routing_map = np.delete(routing_map.numpy(), last_rows[batch], axis=0)
        np.testing.assert_array_equal(routing_map, maps[batch][layers[position]])


@pytest.mark.parametrize("experts", [(), ("--moe-grouped-gemm",)], ids=["sequential", "grouped"])
def test_megatron_r3_reproduces_engine_routing_and_log_probs(checkpoints, rollout, experts):
    _, trainer_checkpoint = checkpoints
    (free, _, free_metrics, _, _), (replayed, reference, metrics, received, _) = run_distributed(
        _free_and_replayed, 1, trainer_checkpoint, rollout, {}, False, experts)[0]
    for ref, old in zip(reference, free):  # the reference routes freely even with R3
        torch.testing.assert_close(ref, old, rtol=0, atol=1e-6)
    _assert_engine_routing(received, rollout, [0, 1])
    assert metrics["train/router_agreement"] < 0.95
    assert _max_mismatch(replayed, rollout) < 1e-3
    assert _max_mismatch(free, rollout) > 0.05
    assert metrics["train/mismatch_ratio_p99"] - metrics["train/mismatch_ratio_p1"] < 1e-3
    assert free_metrics["train/mismatch_ratio_p99"] - free_metrics["train/mismatch_ratio_p1"] > 0.1
    assert "train/router_agreement" not in free_metrics


@pytest.mark.slow  # ~30 s; CI's budget for these tests keeps the TP/SP/EP case and the single-stage ones
def test_megatron_replay_over_two_pipeline_stages(checkpoints, rollout):
    """PP=2: with R3 each stage replays its own MoE layer, the old log-probs (from the last stage) match the
    rollout's and both stages report the agreement of both layers (summed over the pipeline). With
    --use-routing-replay each stage's record holds its own layer's picks (the other layer's rows route freely)."""
    _, trainer_checkpoint = checkpoints
    stages = run_distributed(_free_and_replayed, 2, trainer_checkpoint, rollout, {"pp": 2}, True)
    for stage, (free, (replayed, _, _metrics, received, _), recorded) in enumerate(stages):
        _assert_engine_routing(received, rollout, [stage])
        assert _max_mismatch(replayed, rollout) < 1e-3
        assert _max_mismatch(free[0], rollout) > 0.05
        for routing_map, record in zip(recorded[3], recorded[4]):  # one MoE layer per stage: map i = micro-batch i
            assert (record[:, 1 - stage] == -1).all()
            ids = torch.zeros_like(routing_map).scatter(1, record[:, stage].long(), True)
            assert torch.equal(ids, routing_map)
    agreements = [stage[1][2]["train/router_agreement"] for stage in stages]
    assert agreements[0] == agreements[1] < 0.95
    first_metrics = stages[0][1][2]
    assert first_metrics["train/router_agreement_layer_min"] <= first_metrics["train/router_agreement_layer_p50"]


def swap_tied_experts(args, rollout_id, step_id, model, optimizer, scheduler):
    """A --custom-before-train-step-hook-path: swap the router rows of experts 0 and 1 (the near-tie), so routing
    freely in the training forward would pick differently from the old-policy pass on the straddling tokens."""
    with torch.no_grad():
        for layer in model.decoder.layers:
            weight = layer.mlp.router.weight
            weight[[0, 1]] = weight[[1, 0]].clone()


# (--use-routing-replay, activation recompute): replayed in the training forward, and in the backward's recompute
RECORD_CASES = ((True, False), (True, True), (False, False))


def _train_with_record(rank, world_size, port, checkpoint, data):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    results = []
    for case, (replay, recompute) in enumerate(RECORD_CASES):
        flags = ["--use-routing-replay"] if replay else []
        if recompute:
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        # --get-mismatch-metrics: an old-policy pass (one step alone would reuse the training forward's log-probs)
        args = make_megatron_args(checkpoint, *flags, "--get-mismatch-metrics", "--micro-batch-size", "2", "--lr", "0",
                                  "--custom-before-train-step-hook-path", f"{__name__}.swap_tied_experts")
        trainer = make_trainer(args, port=port + case)
        received = _capture_routing_maps(trainer)
        metrics = trainer.train(0, data)
        destroy_model_parallel()
        torch.distributed.destroy_process_group()
        results.append((received, metrics))
    return results


def test_megatron_routing_replay_trains_on_the_recorded_routing(checkpoints, rollout):
    """--use-routing-replay: the training forward, and with recompute the backward's second forward, use exactly
    the experts of the old-policy pass although the router changed in between; without it they route anew."""
    _, trainer_checkpoint = checkpoints
    results = run_distributed(_train_with_record, 1, trainer_checkpoint, rollout)[0]
    num_old = 2 * 2  # two micro-batches x two MoE layers
    for (replay, recompute), (received, metrics) in zip(RECORD_CASES, results):
        old_pass, training = received[:num_old], received[num_old:]
        # Per micro-batch the layers route forward (0, 1), and with recompute again in the backward (1, 0).
        layer_order = (0, 1, 1, 0) if recompute else (0, 1)
        expected = [old_pass[2 * micro_batch + layer] for micro_batch in (0, 1) for layer in layer_order]
        assert len(training) == len(expected)
        same = all(torch.equal(a, b) for a, b in zip(expected, training))
        assert same == replay, (replay, recompute)
        assert (metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-4)) == replay


def _sequence_parallel_passes(rank, world_size, port, checkpoint, data):
    """TP=2 with sequence parallelism and EP=2 (each rank routes half of each packed row): the log-probs routing
    freely, replaying the engine's routing, and replaying the free pass's record; the R3 pass's agreement counts."""
    from slime.backends.megatron_utils.micro_batches import run_micro_batches
    from slime.backends.megatron_utils.moe_router import install_routers
    from slime.backends.packing import pack_samples
    from slime.backends.routing_replay import ReplayStage, attach_records, attach_rollout_routing

    args = make_megatron_args(checkpoint, "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                              "--expert-model-parallel-size", world_size, world_size=world_size, tp=world_size)
    chunks, hf_config = build_megatron(args, rank, world_size, port)
    replay = install_routers(chunks, hf_config)
    schedule = [[pack_samples(data["tokens"], data["response_lengths"], batch) for batch in ([0, 1], [2, 3])]]

    def log_probs(stage):
        replay.stage = stage
        outputs = run_micro_batches(chunks, schedule[0], temperature=1.0, vocab_size=hf_config.vocab_size,
                                    device=torch.device("cpu"), routing_replay=replay)
        return [lp for lp, _ in outputs]

    free = log_probs(ReplayStage.RECORD)
    attach_records(schedule, replay.take_records())
    from_record = log_probs(ReplayStage.REPLAY_BACKWARD)
    attach_rollout_routing(schedule, data, replay)
    replayed = log_probs(ReplayStage.REPLAY_FORWARD)
    return free, from_record, replayed, replay.take_agreement()


def test_megatron_r3_with_sequence_parallel_and_expert_parallel(checkpoints, rollout):
    """Sequence parallelism splits each packed row over the TP ranks: each rank replays its slice of the engine's
    routing (padded to the row's padded length), its record is gathered to the whole row, and the agreement counts
    every replayed token once."""
    _, trainer_checkpoint = checkpoints
    results = run_distributed(_sequence_parallel_passes, 2, trainer_checkpoint, rollout)
    rollout_log_probs = [torch.tensor(sum((rollout["rollout_log_probs"][i] for i in batch), []))
                         for batch in ([0, 1], [2, 3])]
    for free, from_record, replayed, agreement in results:
        for batch in range(2):
            torch.testing.assert_close(from_record[batch], free[batch], rtol=0, atol=1e-6)
            assert float((replayed[batch] - rollout_log_probs[batch]).abs().max()) < 1e-3
        assert max(float((f - r).abs().max()) for f, r in zip(free, rollout_log_probs)) > 0.05
        num_routed = sum(len(tokens) - 1 for tokens in rollout["tokens"])  # every token but each sample's last
        assert agreement[:, 1].tolist() == [num_routed] * 2
        assert 0 < float(agreement[:, 0].sum()) < 0.95 * 2 * num_routed
