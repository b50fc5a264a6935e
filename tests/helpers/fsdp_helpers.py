"""Shared helpers for the FSDP trainer tests: tiny checkpoints, args, synthetic train data, process spawning."""

from __future__ import annotations

import io
import os
import random
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.config.arguments import parse_args
from slime.utils.misc import find_free_port


def make_args(hf_checkpoint, *extra, world_size=1, **overrides):
    argv = ["--hf-checkpoint", str(hf_checkpoint), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--num-rollout", "4", "--rm-type", "math", "--device", "cpu",
            "--actor-num-gpus-per-node", str(world_size), *map(str, extra)]
    args = parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def make_train_data(num_samples: int, vocab_size: int, seed: int = 0, *, num_steps: int = 1,
                    global_batch_size: int | None = None, with_rollout_log_probs: bool = False) -> dict:
    """Random samples of uneven lengths with partial loss masks and rewards in [-1, 1]."""
    rng = random.Random(seed)
    data = {key: [] for key in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward",
                                "group_indices", "sample_indices", "truncated")}
    if with_rollout_log_probs:
        data["rollout_log_probs"] = []
    for i in range(num_samples):
        prompt_length, response_length = rng.randint(2, 9), rng.randint(1, 12)
        data["tokens"].append([rng.randrange(3, vocab_size) for _ in range(prompt_length + response_length)])
        data["response_lengths"].append(response_length)
        mask = [1 if rng.random() > 0.2 else 0 for _ in range(response_length)]
        data["loss_masks"].append(mask)
        reward = rng.uniform(-1, 1)
        data["rewards"].append(reward)
        data["raw_reward"].append(reward)
        data["group_indices"].append(i // 2)
        data["sample_indices"].append(i)
        data["truncated"].append(0)
        if with_rollout_log_probs:
            data["rollout_log_probs"].append([-rng.uniform(0.5, 8.0) for _ in range(response_length)])
    data.update(rollout_id=0, num_steps_per_rollout=num_steps,
                global_batch_size=global_batch_size or num_samples // num_steps)
    return data


def old_values_off_the_clip_edge(values: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Critic tests' old values: 0.05 or 0.5 away from `values`, either side, so every token is clearly inside or
    clearly outside the value clip range (0.2): both branches of the value loss run, and rounding differences between
    runs cannot move a token across the edge."""
    generator = torch.Generator().manual_seed(seed)
    old = []
    for v in values:
        sign = torch.randint(0, 2, (len(v),), generator=generator) * 2 - 1
        far = torch.randint(0, 2, (len(v),), generator=generator).bool()
        old.append(v + sign * torch.where(far, 0.5, 0.05))
    return old


def rank_slice(data: dict, rank: int, world_size: int) -> dict:
    """Split a global train-data dict as the RolloutManager does: each step's samples dealt evenly to ranks."""
    num_steps = data["num_steps_per_rollout"]
    per_step = len(data["tokens"]) // num_steps
    per_rank = per_step // world_size
    indices = [step * per_step + rank * per_rank + j for step in range(num_steps) for j in range(per_rank)]
    out = {k: [v[i] for i in indices] if isinstance(v, list) else v for k, v in data.items()}
    return out


def _worker(rank, world_size, port, fn, payload, queue):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        result = fn(rank, world_size, port, *payload)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # by value: the worker may exit before the parent reads shared tensors
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *payload, timeout: float = 300.0) -> list:
    """Run fn(rank, world_size, port, *payload) in `world_size` spawned processes; return results by rank.
    Ports port .. port + 7 are free for fn's process groups, one after another."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = find_free_port(count=8)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, payload, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world_size):
        rank, status, value = queue.get()
        if status != "ok":
            for p in procs:
                p.kill()
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    for p in procs:
        p.join(timeout)
    return [results[r] for r in range(world_size)]


def make_trainer(args, rank: int = 0, world_size: int = 1, port: int | None = None, with_ref: bool = False):
    from slime.backends.factory import create_trainer

    trainer = create_trainer(args, rank, world_size, "127.0.0.1", port or find_free_port())
    trainer.start_rollout_id = trainer.init(with_ref=with_ref)
    return trainer


def capture_grads(trainer) -> list[dict]:
    """Record the full gradients seen by every optimizer step (the step itself still runs)."""
    from torch.distributed.tensor import DTensor

    captured = []

    def record(optimizer, args, kwargs):
        captured.append({name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                         for name, p in trainer.model.named_parameters()})

    trainer.backend.optimizer.register_step_pre_hook(record)
    return captured


def full_params(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in trainer.model.named_parameters()}
