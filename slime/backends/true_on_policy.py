"""The trainers' side of `--true-on-policy-mode`: a packed micro-batch's response log-probs and entropy computed by
the batch-invariant decoder the engine runs (slime/engine/true_on_policy/), sample by sample, over the tiles the
engine would use, with the trainer's own parameters (differentiable). Shared by both backends: each hands over its
decoder layers' weights as `LayerWeights` (Hugging Face q/k/v and gate/up concatenated in the engine's fused order).

The packing of the micro-batch does not change any number: each sample restarts at tile 0 with its own keys and
values. Not a fast path: memory and time grow with the tiles' per-tile attention (see docs/guides/true-on-policy.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.engine.true_on_policy import tile_decoder, tile_ops
from slime.engine.true_on_policy.tile_decoder import DecoderSpec, LayerKV, LayerWeights
from slime.engine.true_on_policy.tile_lora import FUSED_SLICES, LayerLora, LoraPair
from slime.engine.true_on_policy.tile_moe import FREE_ROW, MoeWeights
from slime.engine.true_on_policy.tile_ops import TILE_ROWS


def true_on_policy_spec(args, weights_path: str, device: torch.device) -> DecoderSpec | None:
    """The batch-invariant decoder's spec under --true-on-policy-mode (refusing, by name, a model it does not
    cover; on the CPU torch then runs single-threaded, as the engine does), else None."""
    if not args.true_on_policy_mode:
        return None
    from slime.engine.models.model_config import load_model_config
    from slime.engine.true_on_policy.contract import decoder_spec, pin_cpu_threads

    spec = decoder_spec(load_model_config(weights_path))
    pin_cpu_threads(device)
    return spec


def _lora_pair(module) -> LoraPair | None:
    """An FSDP LoRALinear's (fsdp_utils/lora.py) adapter while enabled (the reference pass disables it)."""
    if not hasattr(module, "lora_A") or not module.adapter_enabled:
        return None
    return LoraPair(module.lora_A.weight, module.lora_B.weight, module.scaling)


def hf_layer_lora(layer) -> LayerLora | None:
    """The LoRA pairs on a transformers decoder layer's linears, None when it has none (or they are disabled)."""
    lora = {fused: [_lora_pair(getattr(layer.self_attn if fused in ("qkv", "o") else layer.mlp, name, None))
                    for name in names]
            for fused, names in FUSED_SLICES.items()}
    return lora if any(pair is not None for pairs in lora.values() for pair in pairs) else None


def hf_layer_weights(layer) -> LayerWeights:
    """A transformers Qwen2 / Qwen3 / Llama / Qwen3-MoE decoder layer's parameters in the engine's fused layout."""
    attn, mlp = layer.self_attn, layer.mlp
    biases = [getattr(attn, name).bias for name in ("q_proj", "k_proj", "v_proj")]
    qk_norm = hasattr(attn, "q_norm")
    moe = None
    if hasattr(mlp, "experts"):
        moe = MoeWeights(router=mlp.gate.weight, gate_up=mlp.experts.gate_up_proj, down=mlp.experts.down_proj,
                         top_k=mlp.gate.top_k, norm_topk_prob=mlp.gate.norm_topk_prob)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv_weight=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        qkv_bias=None if biases[0] is None else torch.cat(biases),
        q_norm=attn.q_norm.weight if qk_norm else None, k_norm=attn.k_norm.weight if qk_norm else None,
        o_weight=attn.o_proj.weight, post_norm=layer.post_attention_layernorm.weight,
        gate_up_weight=None if moe else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down_weight=None if moe else mlp.down_proj.weight, moe=moe, lora=hf_layer_lora(layer),
    )


@dataclass(frozen=True)
class TileLayout:
    """Where each sample of a packed row lies: its length and its first tile in the stacked tiles. `routing`: the
    experts to replay (R3), [num_tiles, TILE_ROWS, num_moe_layers, top_k] in the stacked tiles' rows, FREE_ROW where
    the router picks (`with_routing`); None routes every token freely."""

    lengths: tuple[int, ...]
    routing: torch.Tensor | None = None

    @property
    def tile_counts(self) -> list[int]:
        return [tile_ops.num_tiles(length) for length in self.lengths]

    def tile_starts(self) -> list[int]:
        starts, total = [], 0
        for count in self.tile_counts:
            starts.append(total)
            total += count
        return starts

    def embed(self, input_ids: torch.Tensor, cu_seqlens: list[int], embed_weight: torch.Tensor) -> torch.Tensor:
        """[num_tiles, TILE_ROWS, hidden] embeddings of every sample of the packed row input_ids [num_tokens]."""
        tiles = [tile_decoder.token_tiles(input_ids[start:end], 0)[0] for start, end in zip(cu_seqlens, cu_seqlens[1:])]
        return embed_weight[torch.cat(tiles)]

    def flat_rows(self, packed_index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Row of each packed position in the stacked tiles viewed as [num_tiles * TILE_ROWS, ...]."""
        sample = torch.searchsorted(cu_seqlens[1:], packed_index, right=True)
        local = packed_index - cu_seqlens[sample]
        first_row = torch.tensor(self.tile_starts(), dtype=torch.long, device=packed_index.device)[sample] * TILE_ROWS
        return first_row + local


    def with_routing(self, routing: torch.Tensor | None, cu_seqlens: torch.Tensor) -> TileLayout:
        """This layout replaying a packed micro-batch's routing [num_tokens, num_moe_layers, top_k] (None: free)."""
        if routing is None:
            return self
        tiled = torch.full((sum(self.tile_counts) * TILE_ROWS, *routing.shape[1:]), FREE_ROW, dtype=torch.long,
                           device=routing.device)
        packed_index = torch.arange(routing.shape[0], device=routing.device)
        tiled[self.flat_rows(packed_index, cu_seqlens.to(routing.device).long())] = routing.long()
        return TileLayout(self.lengths, tiled.view(-1, TILE_ROWS, *routing.shape[1:]))


def layer_over_samples(spec: DecoderSpec, weights: LayerWeights, hidden: torch.Tensor, layout: TileLayout,
                       moe_layer: int | None = None) -> torch.Tensor:
    """Stacked tiles of every sample through one decoder layer, each sample with its own keys and values; a MoE
    layer (MoE layer number `moe_layer`) replays the layout's routing."""
    outputs = []
    for first, count, length in zip(layout.tile_starts(), layout.tile_counts, layout.lengths):
        routing = None
        if layout.routing is not None and weights.moe is not None:
            routing = layout.routing[first : first + count, :, moe_layer]
        outputs.append(tile_decoder.layer_tiles(spec, weights, hidden[first : first + count], 0, LayerKV(), 0, length,
                                                routing))
    return torch.cat(outputs)


def head_log_probs_and_entropy(final_hidden: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor,
                               spec: DecoderSpec, layout: TileLayout, logit_index: torch.Tensor,
                               target_ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float):
    """(log_probs, entropy) [num_response_tokens] of the targets at the packed positions `logit_index`."""
    normed = tile_decoder.final_norm(final_hidden, norm_weight, spec.rms_norm_eps)
    log_probs = tile_decoder.tile_log_probs(normed, lm_head, temperature).flatten(0, 1)
    rows = layout.flat_rows(logit_index, cu_seqlens.to(logit_index.device).long())
    selected = log_probs.index_select(0, rows)
    # advanced indexing: a new tensor, not a view (FSDP2's root output must not be a view of its graph)
    token_log_probs = selected[torch.arange(selected.shape[0], device=selected.device), target_ids.long()]
    return token_log_probs, tile_ops.entropy(selected)


def _tile_layer_forward(layer, spec: DecoderSpec, weights_of, moe_layer: int | None, hidden: torch.Tensor,
                        layout: TileLayout):
    return layer_over_samples(spec, weights_of(layer), hidden, layout, moe_layer)


def install_tile_layers(layers, spec: DecoderSpec, weights_of=hf_layer_weights) -> None:
    """Make each decoder layer's forward the batch-invariant one, `layer(hidden_tiles, layout)`: the call still goes
    through the module, so the hooks a sharding wrapper put on it (FSDP2's gather and gradient reduction) run. The
    sparse layers (those with `mlp.experts`) are numbered in order: MoE layer i replays routing column i."""
    import functools

    num_moe_layers = 0
    for layer in layers:
        moe_layer = None
        if hasattr(layer.mlp, "experts"):
            moe_layer, num_moe_layers = num_moe_layers, num_moe_layers + 1
        layer.forward = functools.partial(_tile_layer_forward, layer, spec, weights_of, moe_layer)


def packed_log_probs_and_entropy(embed_weight: torch.Tensor, layers, norm_weight: torch.Tensor,
                                 lm_head: torch.Tensor, spec: DecoderSpec, input_ids: torch.Tensor,
                                 logit_index: torch.Tensor, target_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                                 temperature: float, routing: torch.Tensor | None = None):
    """A packed micro-batch (input_ids [1, num_tokens] or [num_tokens]) through `layers`, each a callable
    `(hidden_tiles, layout) -> hidden_tiles` (modules made by `install_tile_layers`, or `layer_over_samples` over a
    backend's weights): (log_probs, entropy) of `target_ids` at the packed positions `logit_index`. `routing`
    [num_tokens, num_moe_layers, top_k]: the experts the MoE layers replay (R3; FREE_ROW rows route freely)."""
    cu = cu_seqlens.tolist()
    layout = TileLayout(tuple(end - start for start, end in zip(cu, cu[1:]))).with_routing(routing, cu_seqlens)
    hidden = layout.embed(input_ids.reshape(-1), cu, embed_weight)
    for layer in layers:
        hidden = layer(hidden, layout)
    return head_log_probs_and_entropy(hidden, norm_weight, lm_head, spec, layout, logit_index, target_ids,
                                      cu_seqlens, temperature)
