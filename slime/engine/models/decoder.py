"""Pre-norm decoder-only transformer covering Qwen2/Qwen2.5 (qkv bias), Qwen3 (per-head q/k RMSNorm), Llama 3
(llama3 RoPE scaling), the mixture-of-experts Qwen3-MoE / Qwen2-MoE (sparse feed-forward blocks in the layers
`ModelConfig.moe_layers` names, `moe_block.py`), GLM-4 (sandwich norms, interleaved partial RoPE) and GLM-4.5
(partial RoPE, sigmoid-router blocks, `sigmoid_moe_block.py`): they differ only in the flags of `ModelConfig`. The
DeepSeek-V3 family swaps the attention for multi-head latent attention (`ModelConfig.mla`, `layers/mla_attention.py`).

Module names follow Hugging Face's (model.layers.N.self_attn..., lm_head) except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj`; `weight_loader.py` is the one place that maps HF names onto them.
Input is a flat batch of tokens (no padding) with their positions and an `AttentionMetadata`; the model knows
nothing of scheduling or sampling.
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


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = [rotary]  # shared table, kept out of this module's parameters and buffers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.use_triton = False  # fused q/k norm + rotary kernel (set by the model runner on CUDA)
        # The fused kernel rotates whole heads rotate-half; partial / interleaved RoPE (GLM) stays on torch.
        self.supports_triton = rotary.fused_kernel_layout

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
                                  self.attn.k_cache, self.attn.v_cache, self.num_heads, q_out)
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
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | MLARotaryEmbedding, layer_index: int):
        super().__init__()
        self.is_sparse = layer_index in config.moe_layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.mla is not None:
            self.self_attn = MLAAttention(config.hidden_size, config.num_attention_heads, config.mla, rotary)
        else:
            self.self_attn = DecoderAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse_block = SigmoidMoeBlock if config.router == "sigmoid" else SparseMoeBlock
        self.mlp = sparse_block(config) if self.is_sparse else DenseMLP(config.hidden_size, config.intermediate_size)
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
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.mla is not None:
            self.rotary = MLARotaryEmbedding(config.mla, config.max_position_embeddings, config.rope_theta)
        else:
            self.rotary = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
                rotary_dim=config.rotary_dim or None, interleaved=config.rope_interleaved,
            )
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary, index)
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
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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
                module.use_triton = enabled and getattr(module, "supports_triton", True)

    def attention_layers(self) -> list[PagedAttention | LatentPagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def moe_blocks(self) -> list[SparseMoeBlock | SigmoidMoeBlock]:
        """The sparse blocks in layer order (empty for a dense model): index i is routed-experts layer i."""
        return [layer.mlp for layer in self.model.layers if layer.is_sparse]
