"""Megatron backend checkpoints in megatron-core's torch_dist format (`dist_checkpointing`) and Megatron-LM's folder
layout (slime/utils/megatron_layout.py), so they reshard (a checkpoint saved at TP=2 loads at TP=1, or any other TP /
PP / EP layout, the optimizer state with it) and move both ways between slime's Megatron and this backend.

Folder: `{save}/iter_{id:07d}/` (iteration = rollout id), named by `{save}/latest_checkpointed_iteration.txt`, holds
the torch_dist files (`metadata.json`, `common.pt` with Megatron-LM's `args` / `iteration` / `checkpoint_version`,
`.metadata`, `*.distcp`: the model weights and, unless --no-save-optim, the distributed optimizer's state: main
weights and Adam moments as sharded tensors laid out like their parameters, optimizer.py) and beside them this
project's run state: `scheduler.pt`, `rng/rank_{r}.pt`, `meta.json` (rollout id, format, the files a resume reads),
the driver's `run_state.json`, and the HF config and tokenizer files of --hf-checkpoint. Written under a temporary
name, renamed when complete, the tracker file last.

Names are Transformer Engine's spec names, the ones slime's checkpoints carry: the local spec's separate norms are
stored as TE's fused ones where TE fuses them (`input_layernorm` as `self_attention.linear_qkv.layer_norm_weight`,
a dense layer's `pre_mlp_layernorm` as `mlp.linear_fc1.layer_norm_weight`, MLA's q / kv norms as
`linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`) and under their own names where TE
keeps them apart (an MoE layer's `pre_mlp_layernorm.weight`, MLA's `input_layernorm.weight`).

A checkpoint another program wrote (slime's Megatron, its tools/convert_hf_to_torch_dist.py) has no meta.json: its
model weights are read (--load, --ref-load, --critic-load, --opd-teacher-load); the architecture is --hf-checkpoint's.

Not the HF export (hf_weights.py writes the --save-hf folders).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from slime.backends.checkpoint_files import barrier, copy_hf_extra_files, rng_state, set_rng_state, torch_load
from slime.utils import megatron_layout
from slime.utils.checkpoint_state import META_FILE, RUN_STATE_FILE, CheckpointError, publish_folder

FORMAT = "torch_dist"
SCHEDULER_FILE = "scheduler.pt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint version (its fused-QKV ordering)
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SHARDED_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(?:\d+\.)?")


def is_torch_dist_checkpoint(path: str | Path) -> bool:
    """A torch_dist checkpoint folder, or a Megatron-LM root whose tracker file names one."""
    return megatron_layout.is_megatron_checkpoint(path) or megatron_layout.is_torch_dist_folder(path)


def checkpoint_folder(path: str | Path) -> Path:
    """The torch_dist folder of `path` (a Megatron-LM root: the folder its tracker file names)."""
    path = Path(path)
    if megatron_layout.is_megatron_root(path):
        try:
            return megatron_layout.checkpoint_folder(path)
        except megatron_layout.MegatronLayoutError as exc:
            raise CheckpointError(str(exc)) from None
    if not megatron_layout.is_torch_dist_folder(path):
        raise CheckpointError(f"{path} is not a Megatron torch_dist checkpoint (no {megatron_layout.TRACKER_FILE} and "
                              f"no {megatron_layout.DIST_METADATA_FILE} of the torch_dist backend); pass an HF folder, "
                              "a --save folder of --train-backend megatron or a Megatron-LM checkpoint")
    return path


def _te_layer_name(layer, name: str) -> str | None:
    """The Transformer Engine spec's name of a local-spec layer state `name` where the two differ (else None)."""
    attention, is_moe = layer.self_attention, hasattr(layer.mlp, "router")
    if name == "input_layernorm.weight":
        return ("self_attention.linear_qkv.layer_norm_weight" if hasattr(attention, "linear_qkv")
                else "input_layernorm.weight")
    if name == "pre_mlp_layernorm.weight":
        return "pre_mlp_layernorm.weight" if is_moe else "mlp.linear_fc1.layer_norm_weight"
    if name == "self_attention.q_layernorm.weight" and hasattr(attention, "linear_q_up_proj"):
        return "self_attention.linear_q_up_proj.layer_norm_weight"
    if name == "self_attention.kv_layernorm.weight" and hasattr(attention, "linear_kv_up_proj"):
        return "self_attention.linear_kv_up_proj.layer_norm_weight"
    return None


def _with_te_names(chunk, state: dict) -> dict:
    """`state` (a chunk's sharded state dict) with its layers' sharded keys renamed to the TE spec's."""
    for key, sharded in state.items():
        match = _LAYER_KEY.match(key)
        if match is None or not hasattr(sharded, "key"):
            continue
        te_name = _te_layer_name(chunk.decoder.layers[int(match[1])], match[2])
        if te_name is not None:
            sharded.key = _SHARDED_LAYER_PREFIX.match(sharded.key)[0] + te_name
    return state


def _model_sharded_state_dict(model_chunks, metadata: dict | None = None) -> dict:
    states = [_with_te_names(chunk, chunk.sharded_state_dict(metadata=metadata)) for chunk in model_chunks]
    if len(states) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


# megatron's distributed optimizer state in its canonical form (each parameter's main weight and Adam moments laid
# out like the parameter, gathered over data parallelism at save, sliced per rank at load): loadable at any
# TP / PP / DP layout. (megatron's 'dp_reshardable' reshards over DP only; 'fully_sharded_model_space' needs the
# flattened ShardedTensors that megatron-core 0.16 no longer supports.) Memory-efficient: the gather runs over the
# gloo data-parallel group into host memory of DP rank 0 (on the CPU the only way; on GPUs it spares device memory).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True}
# Content metadata (Megatron-LM reads it back to build the same sharded state dicts); the model's own keys.
MODEL_METADATA_KEYS = ("non_homogeneous_layers", "singleton_local_shards")
# Checkpoint entries that are not the model's weights: the run state Megatron-LM keeps beside them, and the
# multi-token-prediction layers of slime's GLM / DeepSeek checkpoints, which no model here builds.
NOT_MODEL_WEIGHTS = ("optimizer", "rng_state", "rerun_state_machine", "mtp.")


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


def _megatron_args(args, hf_config, iteration: int, *, save_optim: bool) -> argparse.Namespace:
    """The `args` Megatron-LM keeps in common.pt and checks on load (check_checkpoint_args): the model shape and the
    parallel layout; no_save_rng (this project's RNG files are its own) and, without optimizer state, no_save_optim
    tell Megatron-LM not to look for those."""
    return argparse.Namespace(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        add_position_embedding=getattr(args, "add_position_embedding", True),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        world_size=dist.get_world_size(), iteration=iteration, no_save_rng=True, no_save_optim=not save_optim,
        ckpt_format=FORMAT)


def _write_torch_dist(tmp: Path, model_chunks, optimizer, hf_checkpoint: str, common: dict) -> None:
    """Collective: `tmp/` (an empty folder first: the torch_dist files of the model, and the optimizer unless None,
    and the `common` entries), this rank's RNG state, and on rank 0 the HF config and tokenizer files."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    sharded = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded_state_dict(optimizer, sharded, is_loading=False)
    dist_checkpointing.save({**sharded, **common}, str(tmp), content_metadata=dict(OPTIMIZER_SHARDING))
    if rank == 0:
        (tmp / "rng").mkdir()
        copy_hf_extra_files(hf_checkpoint, tmp)
    barrier()
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")


def _write_meta(folder: Path, rollout_id: int, files: list[str], *, optimizer: bool, hf_checkpoint: str) -> None:
    files = [megatron_layout.DIST_METADATA_FILE, "common.pt", "config.json", *files,
             *(f"rng/rank_{r}.pt" for r in range(dist.get_world_size()))]
    (folder / META_FILE).write_text(json.dumps({"rollout_id": rollout_id, "format": FORMAT, "files": files,
                                                "optimizer": optimizer, "hf_checkpoint": str(hf_checkpoint)}))


def _publish(tmp: Path, final: Path, tracker_value: str, rank: int) -> None:
    """Collective, after every rank wrote its part of `tmp`: rename it to `final`, then point the tracker file at
    it, both atomic (a crash leaves the previous checkpoint as the latest)."""
    barrier()
    if rank == 0:
        publish_folder(tmp, final)
        megatron_layout.write_tracker(final.parent, tracker_value)
    barrier()


def _has_stepped(optimizer, device) -> bool:
    """Whether any rank's slice of the distributed optimizer holds Adam state (a rank's slice may be empty)."""
    stepped = torch.tensor([float(any(inner.optimizer.state for inner in optimizer.chained_optimizers))],
                           device=device)
    dist.all_reduce(stepped, op=dist.ReduceOp.MAX)
    return bool(stepped.item())


def save_checkpoint(save_root: str, rollout_id: int, model_chunks, optimizer, scheduler, *, save_optim: bool,
                    run_state: dict | None, args, hf_config) -> Path:
    """Collective: every rank calls it. Returns the final folder, `{save_root}/iter_{rollout_id:07d}`. An optimizer
    that has not stepped yet (the actor during --num-critic-only-steps) has no state to save: the checkpoint then
    holds none, and a resume starts the optimizer fresh, as it is."""
    rank = dist.get_rank()
    save_optim = save_optim and _has_stepped(optimizer, next(model_chunks[0].parameters()).device)
    final = megatron_layout.iteration_dir(save_root, rollout_id)
    tmp = final.with_name(final.name + ".tmp")
    common = {"args": _megatron_args(args, hf_config, rollout_id, save_optim=save_optim),
              "checkpoint_version": CHECKPOINT_VERSION, "iteration": rollout_id}
    _write_torch_dist(tmp, model_chunks, optimizer if save_optim else None, args.hf_checkpoint, common)
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        files = [SCHEDULER_FILE]
        if run_state is not None:
            (tmp / RUN_STATE_FILE).write_text(json.dumps(run_state))
            files.append(RUN_STATE_FILE)
        _write_meta(tmp, rollout_id, files, optimizer=save_optim, hf_checkpoint=args.hf_checkpoint)
    _publish(tmp, final, str(rollout_id), rank)
    return final


def save_weights(root: str | Path, model_chunks, args, hf_config) -> Path:
    """Collective: a weights-only Megatron-LM checkpoint as slime's tools/convert_hf_to_torch_dist.py writes it,
    `{root}/release/` named by the tracker file's `release` (+ the HF config and tokenizer files): loadable as
    --ref-load / --load / --critic-load / --opd-teacher-load here and in slime, and by
    tools/convert_torch_dist_to_hf.py."""
    root = Path(root)
    final = root / megatron_layout.RELEASE_DIR
    tmp = final.with_name(final.name + ".tmp")
    common = {"args": _megatron_args(args, hf_config, 0, save_optim=False), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": 0}
    _write_torch_dist(tmp, model_chunks, None, args.hf_checkpoint, common)
    _publish(tmp, final, megatron_layout.RELEASE_DIR, dist.get_rank())
    return root


def _checkpoint_keys(folder: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def common_state(folder: Path) -> dict:
    """The checkpoint's common.pt (Megatron-LM's `args`, `iteration`, content metadata). Read in full, not in
    torch.load's weights-only mode: the `args` of slime's Megatron may hold any object its flags set; the checkpoint
    is the user's own."""
    path = folder / "common.pt"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no common.pt: not a complete torch_dist checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def _model_metadata(folder: Path) -> dict:
    """How the checkpoint's model entries were laid out (Megatron-LM's content metadata; for checkpoints without
    it, per-layer keys mean non-homogeneous layers), so this model's sharded state dict asks for the same keys."""
    content = common_state(folder).get("content_metadata") or {}
    metadata = {key: content[key] for key in MODEL_METADATA_KEYS if key in content}
    if "non_homogeneous_layers" not in metadata:
        metadata["non_homogeneous_layers"] = any(re.match(r"^decoder\.layers\.\d+\.", key)
                                                 for key in _checkpoint_keys(folder))
    return metadata


def load_model_weights(ckpt: str | Path, model_chunks, skip: tuple[str, ...] = ()) -> None:
    """Collective: the model weights of a torch_dist checkpoint (a folder, or a Megatron-LM root: the folder its
    tracker file names), resharded to this run's layout (but those named in `skip`, which keep their values: a policy
    checkpoint's output layer under a critic's value head). Every weight must be in the checkpoint; the linear
    layers' `_extra_state` (Transformer Engine's FP8 metadata, which the local spec's layers ignore) is not read: a
    TE checkpoint's may be laid out otherwise (grouped experts) or absent."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    folder = checkpoint_folder(ckpt)
    sharded = {key: {name: tensor for name, tensor in state.items()
                     if name not in skip and not name.endswith("._extra_state")}
               for key, state in _model_sharded_state_dict(model_chunks, _model_metadata(folder)).items()}
    loaded, unread, absent = dist_checkpointing.load(sharded, str(folder), strict=StrictHandling.RETURN_ALL)
    absent = sorted(absent)
    unread = sorted(key for key in unread if not (key.startswith(NOT_MODEL_WEIGHTS) or key.endswith("_extra_state")
                                                   or key in skip))
    if absent or unread:
        raise CheckpointError(f"{folder} holds another architecture than --hf-checkpoint's config.json describes (or "
                              "names its parameters otherwise than Transformer Engine's spec): "
                              + "; ".join(f"{what} {len(keys)} weight(s), e.g. {', '.join(keys[:4])}"
                                          for what, keys in (("it lacks", absent), ("this model has no", unread))
                                          if keys))
    _load_into_chunks(model_chunks, loaded)


def _load_into_chunks(model_chunks, loaded: dict) -> None:
    for i, chunk in enumerate(model_chunks):
        state = loaded["model"] if len(model_chunks) == 1 else loaded[f"model{i}"]
        chunk.load_state_dict(state, strict=False)


def load_training_state(ckpt: Path, model_chunks, optimizer, scheduler) -> int:
    """Collective: optimizer (when saved), schedule and this rank's RNG. Returns the saved rollout id."""
    from megatron.core import dist_checkpointing

    if not (ckpt / META_FILE).is_file():  # another program's checkpoint: weights only (loaded with the model)
        return _foreign_iteration(ckpt)
    meta = json.loads((ckpt / META_FILE).read_text())
    if meta["optimizer"]:
        _init_optimizer_state(optimizer)
        sharded = _model_sharded_state_dict(model_chunks)
        template = {"optimizer": _optimizer_sharded_state_dict(optimizer, sharded, is_loading=True)}
        optimizer.load_state_dict(dist_checkpointing.load(template, str(ckpt))["optimizer"])
    scheduler.load_state_dict(torch_load(ckpt, ckpt / SCHEDULER_FILE))
    rng_file = ckpt / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # a resume on more ranks than were saved: the new ranks keep their seeded state
        set_rng_state(torch_load(ckpt, rng_file))
    return int(meta["rollout_id"])


def _foreign_iteration(folder: Path) -> int:
    """The iteration a Megatron-LM checkpoint of another program was saved at (common.pt's, else the folder's name;
    `release`: -1): the run goes on at the next rollout, its optimizer and data order starting fresh."""
    import logging

    if folder.name == megatron_layout.RELEASE_DIR:  # weights to start from (the converter's): rollout 0 comes next
        return -1
    iteration = common_state(folder).get("iteration")
    if iteration is None:
        iteration = megatron_layout.folder_iteration(folder) or 0
    logging.getLogger(__name__).warning(
        "--load %s: a Megatron-LM checkpoint without this project's run state (slime's?): its model weights are "
        "loaded; the optimizer and the data order start fresh at rollout %d", folder, int(iteration) + 1)
    return int(iteration)
