"""Pre-norm decoder-only transformer covering Qwen2/Qwen2.5 (qkv bias), Qwen3 (per-head q/k RMSNorm), Llama 3
(llama3 RoPE scaling), the mixture-of-experts Qwen3-MoE / Qwen2-MoE (sparse feed-forward blocks in the layers
`ModelConfig.moe_layers` names, `moe_block.py`), GLM-4 (sandwich norms, interleaved partial RoPE) and GLM-4.5
(partial RoPE, sigmoid-router blocks, `sigmoid_moe_block.py`): they differ only in the flags of `ModelConfig`. The
DeepSeek-V3 family swaps the attention for multi-head latent attention (`ModelConfig.mla`, `layers/mla_attention.py`).

Module names follow Hugging Face's (model.layers.N.self_attn..., lm_head) except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj`; `weight_loader.py` is the one place that maps HF names onto them.
Input is a flat batch of tokens (no padding) with their positions and an `AttentionMetadata`; the model knows
nothing of scheduling or sampling.

Built with a `ParallelState` of tp_size N, the model is rank tp_rank's shard of an N-rank engine (engine/parallel/):
attention by heads (its KV cache holds only the rank's K/V heads), MLPs by their intermediate dimension, the
vocabulary by rows, MoE experts by EP block and intermediate slice; every rank computes the full logits, equal to
the one-device model's. A layout that does not divide is refused when the model is built.
"""

from __future__ import annotations

import torch
from torch import nn

from slime.engine.layers.attention import AttentionMetadata, PagedAttention
from slime.engine.layers.latent_attention import LatentPagedAttention
from slime.engine.layers.mla_attention import MLAAttention
from slime.engine.layers.mla_rotary import MLARotaryEmbedding
from slime.engine.layers.rmsnorm import RMSNorm, torch_rms_norm
from slime.engine.layers.rotary import RotaryEmbedding
from slime.engine.models.dense_mlp import DenseMLP
from slime.engine.models.model_config import ModelConfig
from slime.engine.models.moe_block import SparseMoeBlock
from slime.engine.models.sigmoid_moe_block import SigmoidMoeBlock
from slime.engine.parallel.linear import QKVParallelLinear, RowParallelLinear
from slime.engine.parallel.state import SINGLE, ParallelState, divide, head_shard
from slime.engine.parallel.vocab import ParallelLMHead, VocabParallelEmbedding


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, parallel: ParallelState = SINGLE):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.qkv_bias, parallel)
        # this rank's heads (all of them at tp_size 1)
        self.num_heads = self.qkv_proj.shard.num_heads
        self.num_kv_heads = self.qkv_proj.shard.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        config.o_proj_bias, parallel, what="num_attention_heads",
                                        input_start=self.qkv_proj.shard.q_start * self.head_dim,
                                        local_input_size=self.q_size)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = [rotary]  # shared table, kept out of this module's parameters and buffers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.use_triton = False  # fused q/k norm + rotary kernel (set by the model runner on CUDA)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, slot_mapping: torch.Tensor,
                q_out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's input stage: q [num_tokens, heads, head_dim] normed and rotated (into `q_out` when
        given), with this step's K/V written into the cache at `slot_mapping` (one fused kernel after the qkv
        matmul with `use_triton`)."""
        qkv = self.qkv_proj(hidden)
        if self.use_triton:  # norms, rotary and the K/V cache writes in one kernel
            from slime.engine.layers.triton_fused import qkv_rope_store

            rotary = self.rotary[0]
            q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            eps = self.q_norm.eps if self.qk_norm else 0.0
            return qkv_rope_store(qkv, q_weight, k_weight, eps, rotary.cos, rotary.sin, positions, slot_mapping,
                                  self.attn.k_cache, self.attn.v_cache, self.num_heads, q_out, rotary.interleaved)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        # q and k heads side by side: their norms and the rotation run once for both (fewer ops per layer).
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            weight = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                self.k_norm.weight.expand(self.num_kv_heads, -1)])
            qk = torch_rms_norm(qk, weight, self.q_norm.eps)
        q, k = self.rotary[0].rotate(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        self.attn.store(k, v, slot_mapping)
        return q if q_out is None else q_out.copy_(q)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn.attend(self.project(positions, hidden, meta.slot_mapping), meta))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | MLARotaryEmbedding, layer_index: int,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        self.is_sparse = layer_index in config.moe_layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.mla is not None:  # served at tp_size 1 (mla_checks.py)
            self.self_attn = MLAAttention(config.hidden_size, config.num_attention_heads, config.mla, rotary)
        else:
            self.self_attn = DecoderAttention(config, rotary, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse_block = SigmoidMoeBlock if config.router == "sigmoid" else SparseMoeBlock
        self.mlp = (sparse_block(config, parallel) if self.is_sparse
                    else DenseMLP(config.hidden_size, config.intermediate_size, parallel))
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:  # GLM-4: each sub-layer's output normed before its residual add
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous sub-layer's output (the embeddings for the first layer, with residual None);
        residual: the residual stream before it. Returns the attention's normed input and the residual stream."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm.add_and_norm(hidden, residual)

    def feed_forward(self, attention_out: torch.Tensor, residual: torch.Tensor,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After the attention (its o_proj output): the MLP's output and the residual stream it must be added to.
        Each add is fused with the norm after it."""
        if self.sandwich_norms:
            attention_out = self.post_self_attn_layernorm(attention_out)
        normed, residual = self.post_attention_layernorm.add_and_norm(attention_out, residual)
        out = self.mlp(normed, slot_mapping) if self.is_sparse else self.mlp(normed)
        return (self.post_mlp_layernorm(out) if self.sandwich_norms else out), residual

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_norm(hidden, residual)
        return self.feed_forward(self.self_attn(positions, normed, meta), residual, meta.slot_mapping)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        if config.mla is not None:
            self.rotary = MLARotaryEmbedding(config.mla, config.max_position_embeddings, config.rope_theta)
        else:
            self.rotary = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
                rotary_dim=config.rotary_dim or None, interleaved=config.rope_interleaved,
            )
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary, index, parallel)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.final_norm(hidden, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's output added to the residual stream and normed (residual None: no layers)."""
        return self.norm(hidden) if residual is None else self.norm.add_and_norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    embedding_weight_name = "model.embed_tokens.weight"  # the HF name of the input embedding (a tied lm_head's)

    def __init__(self, config: ModelConfig, parallel: ParallelState = SINGLE):
        super().__init__()
        check_parallel_layout(config, parallel)
        self.config = config
        self.parallel = parallel
        self.model = DecoderModel(config, parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size]; call `compute_logits` on the rows that need them."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """float32 logits, or the head's own dtype (upcast=False: the sampler reads bf16 logits in one pass)."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def set_use_triton(self, enabled: bool) -> None:
        """Route norms, q/k norm + rotary and SiLU-and-mul through the fused Triton kernels (CUDA only)."""
        for module in self.modules():
            if hasattr(module, "use_triton"):
                module.use_triton = enabled

    def attention_layers(self) -> list[PagedAttention | LatentPagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def moe_blocks(self) -> list[SparseMoeBlock | SigmoidMoeBlock]:
        """The sparse blocks in layer order (empty for a dense model): index i is routed-experts layer i."""
        return [layer.mlp for layer in self.model.layers if layer.is_sparse]


def check_parallel_layout(config: ModelConfig, parallel: ParallelState) -> None:
    """Refuse, naming the flag and the checkpoint's config field, a --tp-size / --ep-size this model cannot be split
    over (heads, K/V heads, intermediate sizes and experts must divide)."""
    tp, ep = parallel.tp_size, parallel.ep_size
    head_shard(config.num_attention_heads, config.num_key_value_heads, parallel)
    if len(config.moe_layers) < config.num_hidden_layers:
        divide(config.intermediate_size, tp, "intermediate_size")
    if not config.is_moe:
        if ep > 1:
            raise ValueError(f"--ep-size {ep} (engine Config.ep_size) splits MoE experts, but this "
                             f"{config.model_type} model is dense; use --ep-size 1")
        return
    if config.num_experts % ep:
        raise ValueError(f"num_experts ({config.num_experts}) is not divisible by --ep-size {ep} (engine "
                         "Config.ep_size); choose an --ep-size that divides it")
    if config.moe_intermediate_size % parallel.moe_tp_size:
        raise ValueError(f"moe_intermediate_size ({config.moe_intermediate_size}) is not divisible by --tp-size "
                         f"{tp} / --ep-size {ep} = {parallel.moe_tp_size}, the ranks that share each block of "
                         "experts (engine Config.tp_size // Config.ep_size); choose sizes that divide it")
    if config.shared_expert_intermediate_size:
        divide(config.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
