"""The engine's forward under `--true-on-policy-mode` (engine Config.true_on_policy): each scheduled sequence runs
alone through the batch-invariant decoder (tile_decoder.py) on the tiles its new tokens fall in, with its own
per-layer keys and values, so its logits do not depend on the batch, the prefill chunking or a prefix-cache hit
(a hit is recomputed here: the paged cache's K/V come from the serving kernels). The sampled token's reported
log-prob is the shared `log_softmax` of its tile, the op the trainer runs.

The sequence's state is dropped when it finishes and whenever the weights change (the next step recomputes its
prefix under the new weights). A MoE layer (tile_moe.py) writes the experts it picks for each computed position to
the block's routed_experts_cache at that position's KV slot, as the serving path does, so return_routed_experts
(the trainer's routing replay, R3) reads them back. A sequence with a LoRA adapter computes its deltas from the
adapter's own tensors (kept per slot when written, tile_lora.py), not the serving slots. Not the serving path: one sequence at a time, no CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slime.engine.true_on_policy import tile_decoder, tile_ops
from slime.engine.true_on_policy.tile_decoder import DecoderSpec, LayerKV, LayerWeights
from slime.engine.true_on_policy.tile_lora import FUSED_SLICES, LayerLora, LoraPair
from slime.engine.true_on_policy.tile_moe import MoeWeights
from slime.engine.true_on_policy.tile_ops import TILE_ROWS


def adapter_layer_lora(adapter, layer_index: int, device, dtype) -> LayerLora | None:
    """An engine adapter's (engine/lora/adapter.py) pairs on decoder layer `layer_index`, None if it adapts none."""
    if adapter is None:
        return None
    lora, found = {}, False
    for fused, names in FUSED_SLICES.items():
        parent = "self_attn" if fused in ("qkv", "o") else "mlp"
        pairs = []
        for name in names:
            pair = adapter.modules.get(f"model.layers.{layer_index}.{parent}.{name}")
            pairs.append(None if pair is None else LoraPair(pair[0].to(device, dtype), pair[1].to(device, dtype),
                                                            adapter.scale))
            found = found or pair is not None
        lora[fused] = pairs
    return lora if found else None


def engine_layer_weights(layer, lora: LayerLora | None = None) -> LayerWeights:
    """Views of an engine `DecoderLayer`'s parameters (its fused qkv_proj and gate_up_proj hold [q; k; v] and
    [gate; up], the order the trainer concatenates; a sparse layer's experts are stored as transformers stores them)."""
    attn, mlp = layer.self_attn, layer.mlp
    moe = None
    if layer.is_sparse:
        moe = MoeWeights(router=mlp.gate.weight, gate_up=mlp.experts.gate_up_proj, down=mlp.experts.down_proj,
                         top_k=mlp.top_k, norm_topk_prob=mlp.norm_topk_prob)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight, qkv_weight=attn.qkv_proj.weight,
        qkv_bias=getattr(attn.qkv_proj, "bias", None),
        q_norm=attn.q_norm.weight if attn.qk_norm else None, k_norm=attn.k_norm.weight if attn.qk_norm else None,
        o_weight=attn.o_proj.weight, post_norm=layer.post_attention_layernorm.weight,
        gate_up_weight=None if moe else mlp.gate_up_proj.weight, down_weight=None if moe else mlp.down_proj.weight,
        moe=moe, lora=lora,
    )


@dataclass
class SequenceState:
    kv: list[LayerKV]
    num_computed: int = 0
    epoch: int = 0
    tokens: list[int] = field(default_factory=list)  # the token ids whose K/V the state holds


class TrueOnPolicyForward:
    def __init__(self, model, spec: DecoderSpec, block_size: int):
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.states: dict[str, SequenceState] = {}
        self.epoch = 0
        self.adapters: dict[int, object] = {}  # LoRA slot -> the LoraAdapter written there

    def set_adapter(self, slot: int, adapter) -> None:
        """A LoRA adapter was written into `slot`: its sequences recompute with it."""
        self.adapters[slot] = adapter
        self.weights_changed()

    def weights_changed(self) -> None:
        """Every state was computed with the old weights: recompute each sequence from position 0 at its next step."""
        self.epoch += 1
        self.states.clear()

    def drop(self, rid: str) -> None:
        self.states.pop(rid, None)

    def last_logits(self, seq, end: int) -> tuple[torch.Tensor, int]:
        """Compute positions up to `end` of the sequence `seq` (the positions its state lacks), returning the
        logits tile [TILE_ROWS, vocab] that holds position end - 1 and that position's row."""
        rid, token_ids = seq.rid, seq.token_ids
        state = self.states.get(rid)
        num_layers = len(self.model.model.layers)
        if (state is None or state.epoch != self.epoch or state.num_computed >= end
                or state.tokens != token_ids[: state.num_computed]):
            state = SequenceState([LayerKV() for _ in range(num_layers)], epoch=self.epoch)
            self.states[rid] = state
        start = state.num_computed
        embed = self.model.model.embed_tokens.weight
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=embed.device)
        tiles, first_tile = tile_decoder.token_tiles(ids, start)
        hidden = embed[tiles]
        adapter = self.adapters.get(seq.lora_slot)
        for index, (layer, kv) in enumerate(zip(self.model.model.layers, state.kv)):
            chosen = [] if layer.is_sparse else None
            lora = adapter_layer_lora(adapter, index, embed.device, embed.dtype)
            hidden = tile_decoder.layer_tiles(self.spec, engine_layer_weights(layer, lora), hidden, first_tile, kv,
                                              start, end, chosen=chosen)
            if chosen and layer.mlp.routed_experts_cache is not None:
                self._record_routing(layer.mlp.routed_experts_cache, seq.block_table, chosen, first_tile, start, end)
        state.num_computed = end
        state.tokens = list(token_ids[:end])
        last = end - 1
        final = tile_ops.rms_norm(hidden[last // TILE_ROWS - first_tile], self.model.model.norm.weight,
                                  self.spec.rms_norm_eps)
        return tile_ops.linear(final, self.model.lm_head.weight), last % TILE_ROWS

    def _record_routing(self, cache: torch.Tensor, block_table: list[int], chosen: list[torch.Tensor],
                        first_tile: int, start: int, end: int) -> None:
        """Positions [start, end)'s expert ids into `cache` [num_cache_slots, top_k] at their KV slots."""
        offset = start - first_tile * TILE_ROWS
        expert_ids = torch.cat(chosen)[offset : offset + end - start]
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[positions // self.block_size]
        slots = (blocks * self.block_size + positions % self.block_size).to(cache.device)
        cache[slots] = expert_ids.to(cache.device, torch.int32)

    def step(self, scheduled) -> tuple[list[int], torch.Tensor, list[torch.Tensor], list[int]]:
        """Run every scheduled sequence's new tokens; for those that sample: their indices in `scheduled`, their
        logits rows [n, vocab], and each one's logits tile and row (for `token_log_probs`)."""
        sample_rows, rows, tiles, tile_rows = [], [], [], []
        for index, item in enumerate(scheduled):
            logits, row = self.last_logits(item.seq, item.start + item.num_new_tokens)
            if item.needs_sample:
                sample_rows.append(index)
                rows.append(logits[row])
                tiles.append(logits)
                tile_rows.append(row)
        return sample_rows, (torch.stack(rows) if rows else None), tiles, tile_rows


def token_log_probs(tiles: list[torch.Tensor], tile_rows: list[int], tokens: torch.Tensor,
                    temperatures: list[float]) -> torch.Tensor:
    """float64 [n]: each sampled token's log-prob from its logits tile, through the shared log_softmax."""
    values = [tile_ops.log_softmax(tile, temperature)[row, token]
              for tile, row, token, temperature in zip(tiles, tile_rows, tokens.tolist(), temperatures)]
    return torch.stack(values).double()
