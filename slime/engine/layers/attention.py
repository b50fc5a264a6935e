"""Paged attention: write the step's K/V into the block cache, then attend every new token over its sequence's
cached prefix plus its chunk.

Two implementations behind one interface, chosen by which fields the model runner fills in `AttentionMetadata`:
- Triton (CUDA): `triton_paged_attention.paged_attention` reads K/V straight from the cache through the block table
  for any mix of prefill chunks and decode tokens; fixed-shape metadata, so decode steps can be CUDA-graphed.
- Pure PyTorch (CPU, and the CUDA fallback): queries are scattered into a padded [num_seqs, max_query_len] layout,
  keys gathered through padded block tables into [num_seqs, max_context_len], and one masked SDPA runs the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slime.engine.dtypes import FP8_DTYPES, to_cache_dtype


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by all layers.

    slot_mapping [num_tokens]: flat cache slot (block_id * block_size + offset) where each new token's K/V goes.
    block_tables [num_seqs, max_num_blocks]: each sequence's blocks, padded with block 0 (never read).
    max_query_len: most new tokens of one sequence in this step.
    Triton path (None on the torch path):
        query_start_loc [num_seqs + 1] int32: cumulative new-token counts (sequence i owns tokens [s_i, s_i+1)).
        seq_lens [num_seqs] int32: tokens in the cache per sequence after this step (0 for a padded row).
    Torch path (None on the Triton path):
        key_slots [num_seqs, max_num_blocks * block_size]: the flat cache slot of every key position of each
            sequence (its block table expanded), computed once per step for every layer's gather.
        token_seq_index / token_query_index [num_tokens]: each new token's sequence and its index within that
            sequence's chunk, to scatter queries into the padded layout and gather outputs back.
        attn_mask [num_seqs, 1, max_query_len, max_num_blocks * block_size]: True where a query may attend a key
            (key position <= query position); padded query rows attend key 0 only so no row is empty.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    token_seq_index: torch.Tensor | None = None
    token_query_index: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def uses_triton(self) -> bool:
        return self.query_start_loc is not None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # [num_blocks, block_size, num_kv_heads, head_dim]; assigned (and freed) by the model runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the step's k, v [num_tokens, num_kv_heads, head_dim] into the cache at `slot_mapping`."""
        for cache, values in ((self.k_cache, k), (self.v_cache, v)):
            flat = cache.view(-1, self.num_kv_heads, self.head_dim)
            rounded = to_cache_dtype(values, cache.dtype)
            if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
                flat, rounded = flat.view(torch.uint8), rounded.view(torch.uint8)
            flat.index_copy_(0, slot_mapping, rounded)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [num_tokens, num_heads, head_dim] over the cache, whose slots already hold this batch's
        K/V (`store`, or the decoder's fused input kernel). Returns [num_tokens, num_heads * head_dim], written
        into `out` (same shape, contiguous) when given."""
        if meta.uses_triton:
            from slime.engine.layers.triton_paged_attention import paged_attention

            attended = paged_attention(
                q.contiguous(),
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.max_query_len,
                self.scale,
                out=None if out is None else out.view(q.shape),
            )
            return attended.reshape(-1, self.num_heads * self.head_dim)
        attended = self._torch_attention(q, meta)
        return attended if out is None else out.copy_(attended)

    def _torch_attention(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_seqs, max_query_len = meta.num_seqs, meta.max_query_len
        keys = self._gather(self.k_cache, meta.key_slots).to(q.dtype)  # an fp8 cache is read back in q's dtype
        values = self._gather(self.v_cache, meta.key_slots).to(q.dtype)
        is_decode = max_query_len == 1 and q.shape[0] == num_seqs  # token i is sequence i's only query
        if is_decode:
            padded_q = q.view(num_seqs, 1, self.num_heads, self.head_dim)
        else:
            padded_q = q.new_zeros(num_seqs, max_query_len, self.num_heads, self.head_dim)
            padded_q[meta.token_seq_index, meta.token_query_index] = q
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),
            keys,
            values,
            attn_mask=meta.attn_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        if is_decode:
            return out.reshape(num_seqs, self.num_heads * self.head_dim)  # [num_seqs, heads, 1, dim]
        out = out.transpose(1, 2)[meta.token_seq_index, meta.token_query_index]
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _gather(self, cache: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
        """[num_seqs, num_kv_heads, max_num_blocks * block_size, head_dim] copy of each sequence's cached K or V
        (index_select over flat slots: ~40% faster on a CPU than indexing the block dimension)."""
        flat = cache.view(-1, self.num_kv_heads, self.head_dim)
        gathered = flat.index_select(0, key_slots.view(-1))
        return gathered.view(*key_slots.shape, self.num_kv_heads, self.head_dim).transpose(1, 2)
