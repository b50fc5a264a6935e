"""GPU checks of the colocated hand-over (skipped without CUDA): with the optimizer state moving on a side stream
(fsdp_utils/offload.py) and the ref kept on the device (weight_snapshot.py), several train steps with an offload +
onload between rollouts give bit for bit the parameters and optimizer state of a run without; ref log-probs from
the device copy equal the host copy's; a parameter written after its early copy to the host (train's end) reaches
the host as written; device memory after each offload is back to the first offload's (plus the
NCCL barrier tensor of the first checkpoint save); and an engine released without its weights (train.py's colocated
release), resumed and pushed, generates what a fresh engine on the pushed weights does."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _trainer(port, checkpoint, save_dir, *extra, offload: bool, **overrides):
    from tests.helpers.fsdp_helpers import make_args, make_trainer

    args = make_args(checkpoint, "--lr", "1e-3", "--micro-batch-size", "2", "--use-kl-loss", "--kl-loss-coef", "0.1",
                     "--ref-load", checkpoint, "--save", save_dir, *extra, device="cuda", offload_train=offload,
                     **overrides)
    return make_trainer(args, port=port, with_ref=True)


def _training_state(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()
    state = {}
    optimizer = trainer.backend.optimizer
    for name, param in trainer.model.named_parameters():
        state[name] = local(param)
        for key, value in optimizer.state.get(param, {}).items():
            state[f"{name}/{key}"] = local(value)
    return state


def _rollouts(rank, world_size, port, checkpoint, save_dir, offload: bool):
    from slime.backends.fsdp_utils.offload import local_tensor
    from tests.helpers.fsdp_helpers import make_train_data

    trainer = _trainer(port, checkpoint, save_dir, offload=offload)
    assert trainer.snapshot.placement == {"actor": False, "ref": True}  # a tiny model fits
    data = make_train_data(8, vocab_size=300, seed=4, num_steps=2)
    after_offload, onloads, host_buffers = [], [], []
    for rollout_id in range(4):
        if offload and rollout_id:
            before = torch.cuda.memory_reserved()
            trainer.onload()
            onloads.append((trainer.device_room.onload_bytes, torch.cuda.memory_reserved() - before))
        trainer.train(rollout_id, data)
        if rollout_id == 1:
            trainer.save_model(rollout_id)  # reads the optimizer state after its early copy started
        if offload:
            trainer.offload()
            assert not trainer.snapshot.device_copies
            on_device = [local_tensor(v) for s in trainer.backend._optimizer.state.values() for v in s.values()
                         if local_tensor(v).is_cuda] + [local_tensor(p) for p in trainer.model.parameters()]
            assert on_device and all(t.untyped_storage().nbytes() == 0 for t in on_device)  # released
            after_offload.append(torch.cuda.memory_allocated())
            offload_state = trainer.backend.training_state
            host_buffers.append([offload_state.host[kind].host_buffer_pointer() for kind in ("parameters",
                                                                                          "optimizer_state")])
    if offload:
        trainer.onload()
        # the optimizer state's and the parameters' pinned host buffers are allocated once and written again by
        # later offloads (rollout 1's save touched the optimizer: its parameters were copied again at the offload),
        # the first offload's tensors of one storage each and the later ones' flat buffers alike
        assert None not in host_buffers[0] and all(buffers == host_buffers[0] for buffers in host_buffers), host_buffers
    return _training_state(trainer), after_offload, onloads


# The allocator's smallest block: the most device memory the run may keep once, after rollout 1 (its first checkpoint
# save and first barrier; what the block holds is not known). Measured on the H200 at c1f4a10: the levels after the
# offloads of rollouts 0, 1, 2 were 67,108,864 / 67,109,376 / 67,109,376 bytes.
ONE_TIME_BYTES = 512


def test_async_offload_onload_between_rollouts_equals_staying_on_the_device(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = str(build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=3, hidden_size=256, intermediate_size=512))
    plain, _, _ = run_distributed(_rollouts, 1, checkpoint, str(tmp_path / "plain"), False)[0]
    moved, after_offload, onloads = run_distributed(_rollouts, 1, checkpoint, str(tmp_path / "moved"), True)[0]
    assert plain.keys() == moved.keys() and any("/exp_avg_sq" in key for key in plain)
    for key in plain:
        assert torch.equal(plain[key], moved[key]), key
    # No device tensor leaks from one hand-over to the next: the level is the same after the offloads of rollouts 1,
    # 2 and 3 (a tensor kept per hand-over would raise each one), and above rollout 0's by at most one allocator
    # block made once (rollout 1 is the first checkpoint save).
    assert after_offload[1] == after_offload[2] == after_offload[3], after_offload
    assert 0 <= after_offload[1] - after_offload[0] <= ONE_TIME_BYTES, after_offload
    # What the trainer predicts an onload takes (device_room: whether it may run beside the engines' release) is
    # never less than what it takes, but for the margin the prediction keeps free.
    from slime.backends.device_room import ONLOAD_MARGIN_FRACTION

    margin = ONLOAD_MARGIN_FRACTION * torch.cuda.mem_get_info()[1]
    assert onloads and all(0 < taken <= predicted + margin for predicted, taken in onloads), onloads


def _written_after_the_early_copy(rank, world_size, port, checkpoint, save_dir):
    from tests.helpers.fsdp_helpers import make_train_data

    trainer = _trainer(port, checkpoint, save_dir, offload=True)
    trainer.train(0, make_train_data(8, vocab_size=300, seed=5, num_steps=2))  # queues the early copies to the host
    shards = lambda: {name: t.detach().cpu().clone() for name, t in trainer.backend.local_weights()}
    trained = shards()
    trainer.snapshot.restore("ref")  # every shard written in place after its early copy
    written = shards()
    trainer.offload()
    with pytest.raises(RuntimeError, match="offloaded: call onload"):  # the storages are empty now
        shards()
    on_host = {name: trainer.backend.training_state.host_value(param).clone()
               for name, param in trainer.model.named_parameters()}
    trainer.onload()
    return trained, written, on_host, shards()


def test_a_parameter_written_after_its_early_copy_is_offloaded_as_written(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = str(build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=7))
    trained, written, on_host, back = run_distributed(_written_after_the_early_copy, 1, checkpoint,
                                                      str(tmp_path / "w"))[0]
    assert any(not torch.equal(trained[name], written[name]) for name in trained)  # the restore changed them
    for name in written:
        assert torch.equal(on_host[name], written[name]), name
        assert torch.equal(back[name], written[name]), name


def _ref_log_probs(rank, world_size, port, checkpoint, save_dir, on_host: bool):
    from tests.helpers.fsdp_helpers import make_train_data

    trainer = _trainer(port, checkpoint, save_dir, *(["--weight-snapshots-on-host"] if on_host else []),
                       offload=True)
    assert trainer.snapshot.placement == ({} if on_host else {"actor": False, "ref": True})
    from slime.backends.schedule import forward_only_schedule

    data = make_train_data(8, vocab_size=300, seed=6, num_steps=2)
    log_prob_schedule = lambda: forward_only_schedule(trainer.args, data, trainer.backend,
                                                      trainer._schedule(data))  # the ref pass's schedule
    initial = trainer.compute_log_probs(log_prob_schedule())  # the actor is still the ref checkpoint
    trainer.train(0, data)
    trainer.offload()
    trainer.onload()  # the ref's device copy comes back on the side stream; the ref pass is its first reader
    per_sample = trainer._prepare(data)[1]
    actor_now = trainer.compute_log_probs(log_prob_schedule())
    return [initial[i] for i in range(8)], per_sample["ref_log_probs"], [actor_now[i] for i in range(8)]


def test_ref_log_probs_from_the_device_copy_equal_the_host_copys(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = str(build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=5))
    initial_host, ref_host, actor_host = run_distributed(_ref_log_probs, 1, checkpoint, str(tmp_path / "h"), True)[0]
    initial_dev, ref_dev, actor_dev = run_distributed(_ref_log_probs, 1, checkpoint, str(tmp_path / "d"), False)[0]
    for i in range(8):
        assert torch.equal(ref_dev[i], ref_host[i]), i
        assert torch.equal(ref_dev[i], initial_dev[i]), i  # the ref is the initial checkpoint
        assert torch.equal(actor_dev[i], actor_host[i]), i  # the actor's weights came back after the ref pass
    assert any(not torch.equal(actor_dev[i], initial_dev[i]) for i in range(8))  # training moved the actor


def _colocated_placement(rank, world_size, port, checkpoint, save_dir, offload_rollout: bool):
    trainer = _trainer(port, checkpoint, save_dir, offload=False, colocate=True, offload_rollout=offload_rollout)
    return trainer.snapshot.placement, sorted(trainer.snapshot.device_copies)


@pytest.mark.parametrize("offload_rollout", [False, True])
def test_a_colocated_trainer_that_keeps_its_state_keeps_its_ref_on_the_device_where_it_fits(tmp_path, offload_rollout):
    """--colocate --no-offload-train: the ref's device copy is placed at start-up against the memory free beside the
    engines (here none), and made there, instead of every ref pass copying weight sets over PCIe."""
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.fsdp_helpers import run_distributed

    checkpoint = str(build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=5))
    placement, on_device = run_distributed(_colocated_placement, 1, checkpoint, str(tmp_path / "s"), offload_rollout)[0]
    # the actor's transient copy (the ref pass's save) is made once and reused, beside the ref's
    assert placement == {"actor": False, "ref": True} and on_device == ["actor", "ref"], (placement, on_device)


def test_engine_released_without_its_weights_then_pushed_equals_a_fresh_engine(tmp_path):
    """train.py's colocated release: the weights discarded (not copied to the host), resumed as one uninitialized
    allocation, then pushed; the KV cache comes back uninitialized (Triton path), and this test fills it with NaN
    before generating, so a kernel reading a slot before writing it would show. Greedy output and log-probs must equal a
    fresh engine's on the pushed weights."""
    from slime.engine.engine import Engine
    from slime.engine.memory_tags import EngineWeightsMissingError
    from slime.engine.models.weight_loader import iterate_checkpoint
    from slime.utils.tiny_model import build_tiny_model

    first = build_tiny_model(tmp_path / "first", arch="qwen3", initializer_range=0.2, seed=0)
    second = build_tiny_model(tmp_path / "second", arch="qwen3", initializer_range=0.2, seed=1)
    prompts = [[10, 20, 30, 40, 50], list(range(5, 40))] * 3
    greedy = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
    fresh = Engine(str(second), device="cuda", num_kvcache_blocks=256)
    expected = fresh.generate(prompts, greedy)
    del fresh
    gc.collect()  # its blocks back to the allocator now, not in the middle of the hand-over below
    engine = Engine(str(first), device="cuda", num_kvcache_blocks=256)
    assert engine.model_runner.use_triton and not engine.model_runner.kv_cache_zeroed
    assert engine.generate(prompts, greedy)[0]["output_ids"] != expected[0]["output_ids"]
    engine.release_memory(None, discard_weights=True)
    assert engine.model_runner.host_weights.buffers is None
    engine.resume_memory(["weights"])
    engine.update_weights_from_tensors(list(iterate_checkpoint(second)), weight_version="1")
    engine.resume_memory(["kv_cache", "cuda_graph"])
    engine.model_runner.kv_cache.fill_(float("nan"))
    outputs = engine.generate(prompts, greedy)
    for output, reference in zip(outputs, expected):
        assert output["output_ids"] == reference["output_ids"]
        assert output["output_log_probs"] == pytest.approx(reference["output_log_probs"], abs=1e-3)
    engine.release_memory(None, discard_weights=True)
    engine.resume_memory(None)
    with pytest.raises(EngineWeightsMissingError, match="discard_weights"):
        engine.generate(prompts, greedy)


def test_decode_graphs_kept_across_colocated_releases_generate_as_a_fresh_engine(tmp_path):
    """train.py's colocated cycle on a built-in engine (weights discarded, no cuda_graph tag: the graphs are parked),
    four times, the pushed checkpoint alternating: every cycle generates what a fresh engine on the pushed weights
    does, and every resume keeps the graphs captured at start-up (weights and KV cache back at the same addresses,
    device_arena.py): no graph is captured again."""
    from slime.engine.engine import Engine
    from slime.engine.models.weight_loader import iterate_checkpoint
    from slime.utils.tiny_model import build_tiny_model

    checkpoints = [build_tiny_model(tmp_path / name, arch="qwen3", initializer_range=0.2, seed=seed)
                   for seed, name in enumerate(["first", "second"])]
    prompts = [[10, 20, 30, 40, 50], list(range(5, 40))] * 3
    greedy = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
    expected = []
    for checkpoint in checkpoints:
        fresh = Engine(str(checkpoint), device="cuda", num_kvcache_blocks=256)
        expected.append(fresh.generate(prompts, greedy))
        del fresh
        gc.collect()
    engine = Engine(str(checkpoints[0]), device="cuda", num_kvcache_blocks=256)
    engine.generate(prompts, greedy)
    runner = engine.model_runner
    assert runner.decode_graphs is not None and runner.kv_storage.buffers.stable
    kept, captures = [], []
    for cycle, which in enumerate([1, 0, 1, 0]):
        engine.release_memory(["weights", "kv_cache"], discard_weights=True)
        engine.resume_memory(["weights"])
        engine.update_weights_from_tensors(list(iterate_checkpoint(checkpoints[which])), weight_version=str(cycle))
        engine.resume_memory(["kv_cache", "cuda_graph"])
        kept.append(runner.decode_graphs is not None)
        graphs_before = runner.graph_capture_stats["graphs"]
        outputs = engine.generate(prompts, greedy)
        captures.append(runner.graph_capture_stats["graphs"] - graphs_before)
        for output, reference in zip(outputs, expected[which]):
            assert output["output_ids"] == reference["output_ids"], (cycle, kept)
            assert output["output_log_probs"] == pytest.approx(reference["output_log_probs"], abs=1e-3)
    print(f"decode graphs kept by the resume of cycles 0-3: {kept}; graphs captured per cycle: {captures}")
    assert kept == [True] * 4 and captures == [0] * 4
