"""Megatron backend checkpoints in megatron-core's torch_dist format (`dist_checkpointing`), so they reshard:
a checkpoint saved at TP=2 loads at TP=1 (or any other TP / PP layout), the optimizer state with it.

Folder: `{save}/rollout_{id}/` (the project's layout, so the driver's `--load` checks and the data-source run state
work for both backends; slime's Megatron writes `iter_{id:07d}/`): `torch_dist/` (model weights and, unless
--no-save-optim, the distributed optimizer's state: main weights and Adam moments as sharded tensors laid out like
their parameters, optimizer.py),
`scheduler.pt`, `rng/rank_{r}.pt`, `meta.json` (rollout id, format, the files a resume reads), the driver's
`run_state.json`, and the HF config and tokenizer files of --hf-checkpoint. Written under a temporary name, renamed
when complete, `{save}/latest` last (fsdp_utils/checkpoint.py's `publish_checkpoint`). Iteration = rollout id.

Not the HF export (hf_weights.py writes the --save-hf folders).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from slime.backends.checkpoint_files import (
    barrier,
    copy_hf_extra_files,
    publish_checkpoint,
    rng_state,
    set_rng_state,
    torch_load,
)
from slime.utils.checkpoint_state import META_FILE, RUN_STATE_FILE, CheckpointError, checkpoint_dir

FORMAT = "torch_dist"
TORCH_DIST_DIR = "torch_dist"
SCHEDULER_FILE = "scheduler.pt"


def is_torch_dist_checkpoint(path: str | Path) -> bool:
    meta = Path(path) / META_FILE
    return meta.is_file() and json.loads(meta.read_text()).get("format") == FORMAT


def _model_sharded_state_dict(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


# megatron's distributed optimizer state in its canonical form (each parameter's main weight and Adam moments laid
# out like the parameter, gathered over data parallelism at save, sliced per rank at load): loadable at any
# TP / PP / DP layout. (megatron's 'dp_reshardable' reshards over DP only; 'fully_sharded_model_space' needs the
# flattened ShardedTensors that megatron-core 0.16 no longer supports.) Memory-efficient: the gather runs over the
# gloo data-parallel group into host memory of DP rank 0 (on the CPU the only way; on GPUs it spares device memory).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True}


def _optimizer_sharded_state_dict(optimizer, model_sharded: dict, *, is_loading: bool) -> dict:
    return optimizer.sharded_state_dict(model_sharded, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)


def _init_optimizer_state(optimizer) -> None:
    """Create Adam's state (the loading template needs its step) without changing any weight: one step at lr 0 over
    zero gradients (megatron's own dummy step runs at the current lr, whose decoupled weight decay would)."""
    groups = optimizer.param_groups
    lrs = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    for inner in optimizer.chained_optimizers:
        inner.optimizer.step()
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _write_torch_dist(tmp: Path, model_chunks, optimizer, hf_checkpoint: str) -> None:
    """Collective: `tmp/torch_dist/` (model, and the optimizer unless None), this rank's RNG state, and on rank 0
    the HF config and tokenizer files (so the folder also names its architecture, e.g. for --ref-load)."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
        (tmp / TORCH_DIST_DIR).mkdir()
        copy_hf_extra_files(hf_checkpoint, tmp)
    barrier()
    sharded = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded_state_dict(optimizer, sharded, is_loading=False)
    dist_checkpointing.save(sharded, str(tmp / TORCH_DIST_DIR))
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")


def _write_meta(folder: Path, rollout_id: int, files: list[str], *, optimizer: bool, hf_checkpoint: str) -> None:
    files = [f"{TORCH_DIST_DIR}/metadata.json", "config.json", *files,
             *(f"rng/rank_{r}.pt" for r in range(dist.get_world_size()))]
    (folder / META_FILE).write_text(json.dumps({"rollout_id": rollout_id, "format": FORMAT, "files": files,
                                                "optimizer": optimizer, "hf_checkpoint": str(hf_checkpoint)}))


def _has_stepped(optimizer, device) -> bool:
    """Whether any rank's slice of the distributed optimizer holds Adam state (a rank's slice may be empty)."""
    stepped = torch.tensor([float(any(inner.optimizer.state for inner in optimizer.chained_optimizers))],
                           device=device)
    dist.all_reduce(stepped, op=dist.ReduceOp.MAX)
    return bool(stepped.item())


def save_checkpoint(save_root: str, rollout_id: int, model_chunks, optimizer, scheduler, *, save_optim: bool,
                    run_state: dict | None, hf_checkpoint: str) -> Path:
    """Collective: every rank calls it. Returns the final folder. An optimizer that has not stepped yet (the actor
    during --num-critic-only-steps) has no state to save: the checkpoint then holds none, and a resume starts the
    optimizer fresh, as it is."""
    rank = dist.get_rank()
    save_optim = save_optim and _has_stepped(optimizer, next(model_chunks[0].parameters()).device)
    final = checkpoint_dir(save_root, rollout_id)
    tmp = final.with_name(final.name + ".tmp")
    _write_torch_dist(tmp, model_chunks, optimizer if save_optim else None, hf_checkpoint)
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        files = [SCHEDULER_FILE]
        if run_state is not None:
            (tmp / RUN_STATE_FILE).write_text(json.dumps(run_state))
            files.append(RUN_STATE_FILE)
        _write_meta(tmp, rollout_id, files, optimizer=save_optim, hf_checkpoint=hf_checkpoint)
    publish_checkpoint(tmp, final, save_root, rank)
    return final


def save_weights(folder: str | Path, model_chunks, hf_checkpoint: str) -> Path:
    """Collective: a weights-only torch_dist folder (tools/convert_hf_to_torch_dist.py): loadable as
    --ref-load / --opd-teacher-load and by tools/convert_torch_dist_to_hf.py, not resumable (no run state)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    _write_torch_dist(tmp, model_chunks, None, hf_checkpoint)
    if dist.get_rank() == 0:
        _write_meta(tmp, 0, [], optimizer=False, hf_checkpoint=hf_checkpoint)
    barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    barrier()
    return folder


def load_model_weights(ckpt: str | Path, model_chunks, skip: tuple[str, ...] = ()) -> None:
    """Collective: the model weights of a torch_dist checkpoint, resharded to this run's layout (but those named in
    `skip`, which keep their values: a policy checkpoint's output layer under a critic's value head)."""
    from megatron.core import dist_checkpointing

    ckpt = Path(ckpt)
    if not is_torch_dist_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt} is not a Megatron torch_dist checkpoint (its {META_FILE} does not say "
                              f"format {FORMAT!r}); pass an HF folder or a --save folder of --train-backend megatron")
    sharded = {key: {name: tensor for name, tensor in state.items() if name not in skip}
               for key, state in _model_sharded_state_dict(model_chunks).items()}
    loaded = dist_checkpointing.load(sharded, str(ckpt / TORCH_DIST_DIR))
    _load_into_chunks(model_chunks, loaded)


def _load_into_chunks(model_chunks, loaded: dict) -> None:
    for i, chunk in enumerate(model_chunks):
        state = loaded["model"] if len(model_chunks) == 1 else loaded[f"model{i}"]
        chunk.load_state_dict(state, strict=False)


def load_training_state(ckpt: Path, model_chunks, optimizer, scheduler) -> int:
    """Collective: optimizer (when saved), schedule and this rank's RNG. Returns the saved rollout id."""
    from megatron.core import dist_checkpointing

    meta = json.loads((ckpt / META_FILE).read_text())
    if meta["optimizer"]:
        _init_optimizer_state(optimizer)
        sharded = _model_sharded_state_dict(model_chunks)
        template = {"optimizer": _optimizer_sharded_state_dict(optimizer, sharded, is_loading=True)}
        optimizer.load_state_dict(dist_checkpointing.load(template, str(ckpt / TORCH_DIST_DIR))["optimizer"])
    scheduler.load_state_dict(torch_load(ckpt, ckpt / SCHEDULER_FILE))
    rng_file = ckpt / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # a resume on more ranks than were saved: the new ranks keep their seeded state
        set_rng_state(torch_load(ckpt, rng_file))
    return int(meta["rollout_id"])
