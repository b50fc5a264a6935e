"""slime's --save-debug-train-data (and the train half of --dump-details): after each rollout's training, one
`torch.save` file with every data-parallel rank's train data and what the flow computed for it.

Payload (slime's format version 2): `{"format_version": 2, "rollout_id", "rank" (the writer), "samples": [one dict
per sample, in sample-index order: data_parallel_rank, sample_index, and each per-sample field: tokens,
response_lengths, loss_masks, rewards, raw_reward, rollout_log_probs, ..., and the flow's log_probs (old policy,
when that pass ran), ref_log_probs, advantages, returns, entropy / ref_entropy (--use-rollout-entropy)],
"dp_shards": [per rank: rank, data_parallel_rank, sample_indices and the fields that are not per sample]}`.
Written by global rank 0 after a gather over its data-parallel group (tensor / pipeline peers hold the same data).

Not the rollout dump (slime/utils/debug_dump.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

# The flow's per-sample tensors, by slime's names.
FLOW_FIELDS = {"old_log_probs": "log_probs", "ref_log_probs": "ref_log_probs", "advantages": "advantages",
               "returns": "returns", "old_entropy": "entropy", "ref_entropy": "ref_entropy"}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return [_to_cpu(item) for item in value]
    return value


def rank_train_data(data: dict, per_sample: dict) -> dict:
    """This rank's train data with the flow's per-sample tensors under slime's names."""
    rank_data = {key: _to_cpu(value) for key, value in data.items()}
    for key, name in FLOW_FIELDS.items():
        if per_sample.get(key) is not None:
            rank_data[name] = _to_cpu(per_sample[key])
    return rank_data


def build_payload(shards: list[dict], rollout_id: int, writer_rank: int) -> dict:
    samples, layout = [], []
    for shard in shards:
        rank_data, dp_rank = shard["rollout_data"], shard["data_parallel_rank"]
        num_local = len(rank_data["tokens"])
        per_sample = {key: value for key, value in rank_data.items()
                      if isinstance(value, list) and len(value) == num_local and key != "sample_indices"}
        layout.append({"rank": shard["rank"], "data_parallel_rank": dp_rank,
                       "sample_indices": list(rank_data.get("sample_indices") or []),
                       **{key: value for key, value in rank_data.items()
                          if key not in per_sample and key != "sample_indices"}})
        indices = rank_data.get("sample_indices")
        for i in range(num_local):
            sample = {"data_parallel_rank": dp_rank, "sample_index": indices[i] if indices else None}
            sample.update({key: column[i] for key, column in per_sample.items()})
            samples.append(sample)
    if all(sample["sample_index"] is not None for sample in samples):
        samples.sort(key=lambda sample: sample["sample_index"])
    return {"format_version": 2, "rollout_id": rollout_id, "rank": writer_rank, "samples": samples,
            "dp_shards": layout}


def save_debug_train_data(path_template: str, rollout_id: int, rank_data: dict, backend) -> Path | None:
    """Collective over the data-parallel group of global rank 0 (other ranks return at once). Returns the file on
    the writer, None elsewhere."""
    rank = dist.get_rank()
    group = backend.dp_group
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if 0 not in members:
        return None
    shard = {"rank": rank, "data_parallel_rank": backend.dp_rank, "rollout_data": rank_data}
    shards = [shard]
    if backend.dp_size > 1:
        shards = [None] * backend.dp_size if rank == 0 else None
        dist.gather_object(shard, shards, dst=0, group=group)
    if rank != 0:
        return None
    path = Path(path_template.format(rollout_id=rollout_id, rank=rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build_payload(shards, rollout_id, rank), path)
    return path
