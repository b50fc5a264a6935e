"""The attention core for Megatron's local layer spec over packed THD micro-batches: causal attention within each
sample of a packed row, never across samples.

megatron-core's local `DotProductAttention` refuses packed sequences (`packed_seq_params` must be None) and
materialises [batch, heads, T, T] scores; Transformer Engine's core (the TE spec) handles THD itself. This module
takes the place of the local core with the FSDP backend's `packed_causal_attention`
(slime/backends/attention.py): the varlen FlashAttention kernel on a GPU that has it (grouped K/V read
directly), elsewhere sdpa over length-bucketed padded samples (exact, no [T, T] mask over the whole row). Input as
Megatron's `Attention` hands it over for qkv_format "thd": query [T, heads, D], key / value [T, kv_heads, D] (this
rank's heads); output [T, heads * D].

With context parallelism (context_parallel.py's layout; `cu_seqlens` are then those of the padded full row) K / V
are gathered over the CP group and each local query chunk attends to its sample's keys up to its own global
position, with torch's sdpa per chunk and an explicit causal mask offset by the chunk's start (on the GPU as well).
No attention dropout (RL training runs without it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from slime.backends.attention import packed_causal_attention
from slime.backends.megatron_utils.context_parallel import CpLayout, context_parallel_group, gather_sequence


class PackedCoreAttention(MegatronModule):
    """`k_channels` / `v_channels`: the query-key and value head dims where they differ (multi-head latent
    attention, which passes its own softmax scale)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.cp_size = config.context_parallel_size
        key_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(key_dim)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is not None and packed_seq_params.qkv_format == "thd", \
            "the Megatron backend feeds packed THD micro-batches only"
        cu_seqlens = packed_seq_params.cu_seqlens_q
        if self.cp_size > 1:
            out = self._context_parallel_attention(query, key, value, packed_seq_params.cp_layout)
        else:
            out = self._packed_attention(query, key, value, cu_seqlens, int(packed_seq_params.max_seqlen_q))
        return out.reshape(out.shape[0], -1)

    def _packed_attention(self, query, key, value, cu_seqlens, max_seqlen: int):
        # A V head narrower than the query-key head (MLA) is padded for FlashAttention inside.
        return packed_causal_attention(query, key, value, cu_seqlens, max_seqlen, self.softmax_scale)

    def _context_parallel_attention(self, query, key, value, layout: CpLayout):
        group = context_parallel_group()
        sample_lengths = layout.sample_lengths
        full_key, full_value = gather_sequence(key, layout, group), gather_sequence(value, layout, group)
        pieces, local_offset, row_start = [], 0, 0
        for length, chunk in zip(sample_lengths, layout.local_chunk_lengths):
            for chunk_index in (layout.cp_rank, 2 * self.cp_size - 1 - layout.cp_rank):
                query_start = chunk_index * chunk  # within the sample
                end = row_start + query_start + chunk
                mask = layout.causal_mask(query_start, chunk, query.device)
                pieces.append(self._masked_attention(query[local_offset:local_offset + chunk],
                                                     full_key[row_start:end], full_value[row_start:end], mask))
                local_offset += chunk
            row_start += length
        return torch.cat(pieces)

    def _masked_attention(self, query, key, value, mask):
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)
