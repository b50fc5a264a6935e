"""Multi-head latent attention (MLA) of the DeepSeek-V3 family, computed by absorption over a latent KV cache.

Per token: q = q_proj(h) (Moonlight) or q_b_proj(q_a_layernorm(q_a_proj(h))) (V3), split per head into q_nope and
q_pe; kv_a_proj_with_mqa(h) = [c_kv | k_pe], c_kv normed by kv_a_layernorm; q_pe and k_pe rotated (`mla_rotary.py`).
The cache keeps [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim values per token, never expanded per head).
kv_b_proj's weight [heads * (nope + v), kv_lora_rank] holds W_UK (the nope rows) and W_UV (the v rows) of each head;
attention then needs no expanded K or V: q_nope · k_nope = (q_nope · W_UK) · c_kv, so every head's absorbed query
[q_nope · W_UK | q_pe] attends the latent rows directly, and the attended latent times W_UV is the head's output.
W_UK and W_UV are views of kv_b_proj.weight taken at each forward, so a weight push into kv_b_proj is followed with
no post-load step. The same absorbed path serves prefill chunks, prefix-cache hits and decode.

Module names follow Hugging Face's, so `weight_loader.py` loads the checkpoint names 1:1. Not the cache's paging
(`latent_attention.py`) or the rotary tables (`mla_rotary.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from slime.engine.layers.attention import AttentionMetadata
from slime.engine.layers.latent_attention import LatentPagedAttention
from slime.engine.layers.mla_rotary import MLARotaryEmbedding
from slime.engine.layers.rmsnorm import RMSNorm
from slime.engine.models.mla_config import LATENT_NORM_EPS, MLAConfig


class MLAAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mla: MLAConfig, rotary: MLARotaryEmbedding):
        super().__init__()
        self.num_heads = num_heads
        self.mla = mla
        bias = mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, num_heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * mla.v_head_dim, hidden_size, bias=bias)
        self.rotary = [rotary]  # shared table, kept out of this module's parameters and buffers
        self.attn = LatentPagedAttention(num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.softmax_scale())

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, kv_lora_rank], W_UV [heads, v, kv_lora_rank]): views of kv_b_proj.weight."""
        m = self.mla
        per_head = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return per_head[:, : m.qk_nope_head_dim], per_head[:, m.qk_nope_head_dim :]

    def project(self, positions: torch.Tensor, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Absorbed queries [num_tokens, heads, kv_lora_rank + rope] (this step's latent rows written to the cache)."""
        m = self.mla
        q = self.q_proj(hidden) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(-1, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        rotary = self.rotary[0]
        k_pe = rotary.rotate(positions, k_pe.unsqueeze(1)).squeeze(1)
        self.attn.store(torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1), slot_mapping)
        w_uk, _ = self.absorbed_weights()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        return torch.cat([q_latent, rotary.rotate(positions, q_pe)], dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.attn.attend(self.project(positions, hidden, meta.slot_mapping), meta)
        _, w_uv = self.absorbed_weights()
        out = torch.einsum("thr,hvr->thv", attended, w_uv)
        return self.o_proj(out.reshape(-1, self.num_heads * self.mla.v_head_dim))
