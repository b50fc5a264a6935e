"""Routing replay for MoE policies: which experts the trainer's routers pick in each pass (slime's stages).

- `fallthrough`: route freely (the reference and teacher passes; every pass without replay).
- `record` (--use-routing-replay, old-policy pass): route freely and keep the picks of every micro-batch, so the
  training forward and backward can replay them (`take_records`).
- `replay_forward` (R3, old-policy pass) and `replay_backward` (training forward and its recompute in the
  backward): use the micro-batch's given routing, from the rollout engine (R3) or from the record.

A backend-neutral object: the model's routers call `select(layer, probs)` for the expert ids (the routing weights
are then the router's own probabilities at those ids, so the router still learns); the backend wraps each
micro-batch's forward (and backward) in `micro_batch(routing)`. Routing rows are per packed token
[num_tokens, num_moe_layers, top_k] (`pack_routing` picks the MoE layers' rows, by layer index, out of the engine's
SGLang-layout record [len(tokens) - 1, num_hidden_layers, top_k]); a row of -1 routes freely (the last token of a sample, which predicts nothing
and that the engine never forwarded). While replaying it also measures the router agreement: per MoE layer, the
fraction of replayed tokens whose free top-k set equals the replayed one (in the replay_forward pass).
Not the router itself (each backend patches its model's, e.g. fsdp_utils/moe_router.py) and not the load-balancing
loss (moe_aux_loss.py).
"""

from __future__ import annotations

import contextlib
import enum

import numpy as np
import torch

from slime.utils.train_data_types import TrainData


class ReplayStage(str, enum.Enum):
    FALLTHROUGH = "fallthrough"
    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


FREE_ROW = -1  # a routing row that the router fills itself


class RoutingReplay:
    """`local_layers`: the MoE layers this process routes (default all; a pipeline stage routes its own), the
    others are FREE_ROW in its records. `layer_indices`: the decoder-layer index of each MoE layer and
    `num_hidden_layers` the decoder's depth, i.e. where the MoE rows sit in an engine record (default: every layer
    is MoE)."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int, local_layers: list[int] | None = None,
                 layer_indices: tuple[int, ...] | None = None, num_hidden_layers: int | None = None):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.layer_indices = tuple(range(num_layers)) if layer_indices is None else tuple(layer_indices)
        self.num_hidden_layers = num_layers if num_hidden_layers is None else num_hidden_layers
        assert len(self.layer_indices) == num_layers and max(self.layer_indices) < self.num_hidden_layers
        self.local_layers = list(range(num_layers)) if local_layers is None else list(local_layers)
        self.stage = ReplayStage.FALLTHROUGH
        self._routing: torch.Tensor | None = None  # the micro-batch in flight's [num_tokens, layers, top_k]
        # Per MoE layer, its picks of each micro-batch in forward order: a layer sees the micro-batches in order
        # even where a pipeline schedule interleaves the forwards of different layers (virtual pipeline stages).
        self._layer_records: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._agreement = torch.zeros(num_layers, 2, dtype=torch.float64)  # per layer: agreeing, replayed tokens

    @property
    def replaying(self) -> bool:
        return self.stage in (ReplayStage.REPLAY_FORWARD, ReplayStage.REPLAY_BACKWARD)

    @contextlib.contextmanager
    def micro_batch(self, routing: torch.Tensor | None):
        """Around one micro-batch's forward (and backward): the routing to replay, [num_tokens, layers, top_k]."""
        self.set_routing(routing)
        try:
            yield
        finally:
            self._routing = None

    def set_routing(self, routing: torch.Tensor | None) -> None:
        """The routing of the micro-batch whose layers run next: `micro_batch` sets it for the forward; a backend
        whose backward recomputes a micro-batch's layers apart from its forward (a pipeline schedule's) sets it
        again before that recompute."""
        if self.replaying and routing is None:
            raise ValueError(f"routing replay ({self.stage.value}): this micro-batch carries no routing record")
        self._routing = routing

    def replayed_routing(self) -> torch.Tensor | None:
        """The micro-batch in flight's routing while replaying, else None (a model that routes its own tiles,
        backends/true_on_policy.py, reads it instead of calling `select`)."""
        return self._routing if self.replaying else None

    def select(self, layer: int, probs: torch.Tensor) -> torch.Tensor:
        """Expert ids [num_tokens, top_k] for `probs` [num_tokens, num_experts] of MoE layer `layer`."""
        free = torch.topk(probs, self.top_k, dim=-1).indices
        if self.stage is ReplayStage.RECORD:
            self._layer_records[layer].append(free.detach())  # stays on the device: no sync
        if not self.replaying:
            return free
        routing = self._routing[:, layer].to(free.device)
        if routing.shape != free.shape:
            raise ValueError(f"routing replay: the record has {tuple(routing.shape)} ids at MoE layer {layer}, "
                             f"the micro-batch routes {tuple(free.shape)}")
        replayed = routing[:, 0] != FREE_ROW
        if self.stage is ReplayStage.REPLAY_FORWARD:  # once per token (a backward's recompute would count twice)
            with torch.no_grad():
                same = (free.sort(dim=-1).values == routing.sort(dim=-1).values).all(dim=-1) & replayed
                self._agreement = self._agreement.to(free.device)  # summed on the device: no sync per layer
                self._agreement[layer, 0] += same.sum()
                self._agreement[layer, 1] += replayed.sum()
        return torch.where(replayed[:, None], routing.long(), free)

    def take_records(self) -> list[torch.Tensor]:
        """The picks of every micro-batch since the last call (record stage), in forward order: per micro-batch
        [num_tokens, num_layers, top_k], FREE_ROW at the layers this process does not route."""
        layer_records, self._layer_records = self._layer_records, [[] for _ in range(self.num_layers)]
        counts = {layer: len(layer_records[layer]) for layer in self.local_layers}
        assert len(set(counts.values())) <= 1, f"MoE layers routed different numbers of micro-batches: {counts}"
        records = []
        for index in range(max(counts.values(), default=0)):
            picks = [layer_records[layer][index] if layer_records[layer] else None for layer in range(self.num_layers)]
            free = torch.full_like(layer_records[self.local_layers[0]][index], FREE_ROW)
            records.append(torch.stack([free if p is None else p for p in picks], dim=1))
        return records

    def take_agreement(self) -> torch.Tensor:
        """Per MoE layer (agreeing tokens, replayed tokens) since the last call, float64 [num_layers, 2]."""
        agreement, self._agreement = self._agreement, torch.zeros_like(self._agreement)
        return agreement.cpu()


def pack_routing(records: list, sample_lengths: list[int], sample_names: list[str], num_layers: int, top_k: int,
                 num_experts: int, layer_indices: tuple[int, ...] | None = None,
                 num_hidden_layers: int | None = None) -> torch.Tensor:
    """One micro-batch's routing [sum(sample_lengths), num_layers, top_k] int32 from per-sample records in the
    engine's (SGLang's) layout [len(tokens) - 1, num_hidden_layers, top_k]: one row per token but the last (the
    last row routes freely), and of each row the MoE layers' entries at `layer_indices` (default: every layer is
    MoE). A missing record, a wrong shape or an expert id out of range is a ValueError naming the sample."""
    layer_indices = list(range(num_layers) if layer_indices is None else layer_indices)
    num_hidden_layers = num_layers if num_hidden_layers is None else num_hidden_layers
    rows = []
    for record, length, name in zip(records, sample_lengths, sample_names):
        if record is None:
            raise ValueError(f"routing replay: {name} has no routing record (rollout_routed_experts)")
        record = np.asarray(record)
        if record.shape != (length - 1, num_hidden_layers, top_k):
            raise ValueError(f"routing replay: {name}'s routing record has shape {record.shape}, expected "
                             f"{(length - 1, num_hidden_layers, top_k)} (len(tokens) - 1, decoder layers, top-k)")
        if num_hidden_layers != num_layers or layer_indices != list(range(num_layers)):
            record = record[:, layer_indices]
        if record.size and (record.min() < 0 or record.max() >= num_experts):
            raise ValueError(f"routing replay: {name}'s routing record holds expert ids outside [0, {num_experts})")
        rows += [record.astype(np.int32, copy=False), np.full((1, num_layers, top_k), FREE_ROW, dtype=np.int32)]
    return torch.from_numpy(np.concatenate(rows))


def agreement_metrics(agreement: torch.Tensor) -> dict:
    """Router agreement engine vs trainer from `take_agreement` (summed over ranks): the overall fraction of
    tokens whose top-k set matches, and quantiles of the per-layer fractions."""
    counts = agreement[agreement[:, 1] > 0]
    if not len(counts):
        return {}
    per_layer = counts[:, 0] / counts[:, 1]
    quantiles = torch.quantile(per_layer, torch.tensor([0.0, 0.1, 0.5], dtype=per_layer.dtype))
    return {
        "train/router_agreement": float(counts[:, 0].sum() / counts[:, 1].sum()),
        "train/router_agreement_layer_min": float(quantiles[0]),
        "train/router_agreement_layer_p10": float(quantiles[1]),
        "train/router_agreement_layer_p50": float(quantiles[2]),
    }


def log_prob_stage(args, store_prefix: str) -> ReplayStage:
    """The stage of a forward-only pass (TrainFlow.compute_log_probs' store_prefix): the policy's old log-probs
    ("", or "pushed:<version>_" with --keep-old-actor) replay the rollout's routing with R3 and record it with
    --use-routing-replay (the plain old-policy pass only); the reference and teacher route freely."""
    if store_prefix in ("ref_", "teacher_"):
        return ReplayStage.FALLTHROUGH
    if args.use_rollout_routing_replay:
        return ReplayStage.REPLAY_FORWARD
    if args.use_routing_replay and store_prefix == "":
        return ReplayStage.RECORD
    return ReplayStage.FALLTHROUGH


def attach_rollout_routing(schedule, data: TrainData, replay: RoutingReplay) -> None:
    """R3: give every packed micro-batch of the schedule the engine's routing of its samples."""
    records = data.get("rollout_routed_experts")
    if records is None:
        raise ValueError("--use-rollout-routing-replay: the train data has no rollout_routed_experts (the rollout "
                         "must ask the engines for return_routed_experts; the default rollout does)")
    names = data.get("sample_indices") or list(range(len(records)))
    for micro_batch in (micro_batch for step in schedule for micro_batch in step):
        indices = micro_batch.sample_indices
        micro_batch.routed_experts = pack_routing(
            [records[i] for i in indices], [len(data["tokens"][i]) for i in indices],
            [f"sample {names[i]}" for i in indices], replay.num_layers, replay.top_k, replay.num_experts,
            replay.layer_indices, replay.num_hidden_layers)


def attach_records(schedule, records: list[torch.Tensor]) -> None:
    """--use-routing-replay: the old-policy pass's picks (one per micro-batch, in forward order) become the routing
    that the training forward and backward of the same micro-batch replay."""
    micro_batches = [micro_batch for step in schedule for micro_batch in step]
    assert len(records) == len(micro_batches), f"{len(records)} routing records for {len(micro_batches)} micro-batches"
    for micro_batch, record in zip(micro_batches, records):
        micro_batch.routed_experts = record
