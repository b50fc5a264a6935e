"""Paged attention over MLA's latent KV cache: one cache row per token and layer holding the normed kv latent
(kv_lora_rank values) and the rotated shared k_pe (qk_rope_head_dim values), 576 for DeepSeek-V3. There is no V
cache: V is the first kv_lora_rank columns of the same row. Queries arrive absorbed ([q_nope · W_UK | q_pe] per
head, `mla_attention.py`), so every head attends the one latent "head" (multi-query attention) and the output is
the attention-weighted latent [num_tokens, heads, kv_lora_rank], which the caller maps through W_UV.

Same interface and metadata as `attention.PagedAttention` (the model runner binds `k_cache`, and `v_cache` to the
same tensor): the pure-torch path (CPU, CUDA fallback) gathers each sequence's rows through `key_slots` and runs
one masked SDPA with V a view of K; on CUDA, after its start-up self-check, `triton_mla_decode.mla_attention`
reads the rows through the block table for decode tokens and prefill chunks alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime.engine.layers.attention import AttentionMetadata


class LatentPagedAttention(nn.Module):
    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = 1  # every query head attends the one latent row
        self.kv_lora_rank = kv_lora_rank
        self.latent_dim = kv_lora_rank + rope_dim
        self.scale = scale
        # [num_blocks, block_size, 1, latent_dim]; assigned (and freed) by the model runner; v_cache is k_cache.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def store(self, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the step's latent rows [num_tokens, latent_dim] into the cache at `slot_mapping`."""
        flat = self.k_cache.view(-1, self.latent_dim)
        flat.index_copy_(0, slot_mapping, latent.to(flat.dtype))

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of absorbed queries q [num_tokens, num_heads, latent_dim] over the cache, whose slots already
        hold this batch's rows. Returns the attended latent [num_tokens, num_heads, kv_lora_rank]."""
        if meta.uses_triton:
            from slime.engine.layers.triton_mla_decode import mla_attention

            return mla_attention(q.contiguous(), self.k_cache, meta.block_tables, meta.query_start_loc,
                                 meta.seq_lens, meta.max_query_len, self.scale, self.kv_lora_rank)
        return self._torch_attention(q, meta)

    def _torch_attention(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_seqs, max_query_len = meta.num_seqs, meta.max_query_len
        flat = self.k_cache.view(-1, self.latent_dim)
        keys = flat.index_select(0, meta.key_slots.view(-1)).view(num_seqs, 1, -1, self.latent_dim).to(q.dtype)
        values = keys[..., : self.kv_lora_rank]
        is_decode = max_query_len == 1 and q.shape[0] == num_seqs  # token i is sequence i's only query
        if is_decode:
            padded_q = q.view(num_seqs, 1, self.num_heads, self.latent_dim)
        else:
            padded_q = q.new_zeros(num_seqs, max_query_len, self.num_heads, self.latent_dim)
            padded_q[meta.token_seq_index, meta.token_query_index] = q
        out = F.scaled_dot_product_attention(padded_q.transpose(1, 2), keys, values, attn_mask=meta.attn_mask,
                                             scale=self.scale, enable_gqa=True)
        if is_decode:
            return out.reshape(num_seqs, self.num_heads, self.kv_lora_rank)  # [num_seqs, heads, 1, rank]
        return out.transpose(1, 2)[meta.token_seq_index, meta.token_query_index]
