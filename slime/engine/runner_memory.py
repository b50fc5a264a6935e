"""The model runner's memory: the KV cache (allocation, freeing, the routing record beside it), the weights' device
storage (release to / restore from a host copy, host_weights.py; loads of full tensors or a checkpoint folder) and
the CUDA graphs set aside across a release. A mixin of `ModelRunner` (model_runner.py); the methods that change a
rank's state are `@every_rank`, so a sharded engine's ranks do them together.
"""

from __future__ import annotations

import numpy as np
import torch

from slime.engine.cuda_graph import baked_addresses
from slime.engine.kv_cache import KVCacheStorage, bytes_per_block, cache_row_shape
from slime.engine.models.weight_loader import load_checkpoint, load_weights
from slime.engine.parallel.every_rank import every_rank


class RunnerMemory:
    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.config, self.model_config, self.kv_dtype, self.num_local_kv_heads)

    @property
    def num_local_kv_heads(self) -> int:
        """The K/V heads this rank's cache stores (all of them at tp_size 1)."""
        return self.model.attention_layers()[0].num_kv_heads

    @property
    def has_kv_cache(self) -> bool:
        return self.model.attention_layers()[0].k_cache.numel() > 0

    @every_rank
    def allocate_kv_cache(self) -> None:
        c = self.model_config
        layers, blocks = self.model.attention_layers(), self.model.moe_blocks()
        if self.kv_storage is None:
            # One storage for every layer's K and V (and the routing record), not two tensors per layer: a colocated
            # run frees and re-allocates the cache on every hand-over, and each allocation is a driver call.
            routing = (len(blocks), c.num_experts_per_tok) if self.config.enable_return_routed_experts else None
            num_planes, num_heads, head_dim = cache_row_shape(c, self.num_local_kv_heads)
            block_shape = (self.num_kvcache_blocks + 1, self.block_size, num_heads, head_dim)
            self.kv_storage = KVCacheStorage(self.device, len(layers), block_shape, self.kv_dtype, routing, num_planes)
        # The pure-torch path needs zeros: its masked-out slots enter SDPA multiplied by 0, and NaN garbage would
        # survive that. The Triton kernels load only slots below each sequence's length, all written before any read
        # (cached prefix, earlier chunks, the step's own K/V), so there the cache is left uninitialized: zeroing
        # the whole cache on every colocated resume costs a device-wide memset.
        self.kv_cache_zeroed = not self.use_triton
        self.kv_cache, self.routed_experts = self.kv_storage.allocate(zeroed=self.kv_cache_zeroed)
        for attn, planes in zip(layers, self.kv_cache):  # MLA's one latent plane is its K and its V
            attn.k_cache, attn.v_cache = planes[0], planes[-1]
        # Indexed by cache slot like the K/V, so prefix-cache hits keep the routing of the tokens they skip.
        for index, block in enumerate(blocks if self.routed_experts is not None else []):
            block.routed_experts_cache = self.routed_experts[:, index]

    @every_rank
    def free_kv_cache(self) -> None:
        self.decode_graphs = self.prefill_graphs = None  # they hold the cache's addresses (parked first if kept)
        self.decode_rows.clear()
        self.kv_cache = None
        for attn in self.model.attention_layers():
            attn.k_cache = torch.empty(0, device=self.device)
            attn.v_cache = torch.empty(0, device=self.device)
        for block in self.model.moe_blocks():
            block.routed_experts_cache = None
        self.routed_experts = None
        self.kv_storage.free()
        self._empty_device_cache()

    @every_rank
    def park_graphs(self, keep: bool) -> None:
        """Before a release: the decode and prefill graphs set aside with the addresses they bake in (`keep`: the
        release keeps their own memory), else dropped; dropped too where the weights or the KV cache would not come
        back at the same addresses (no arena: keeping them would only hold their memory through the trainer's
        turn)."""
        keep = keep and self.host_weights.stable and self.kv_storage is not None and self.kv_storage.stable
        for parked, graphs in ((self.parked_graphs, self.decode_graphs),
                               (self.parked_prefill_graphs, self.prefill_graphs)):
            if keep and graphs is not None:
                parked.park(graphs, self._baked_addresses())
            elif not keep:
                parked.clear()
        self.decode_graphs = self.prefill_graphs = None

    @every_rank
    def unpark_graphs(self) -> tuple[bool, bool]:
        """After a resume of the weights and KV cache: the parked graphs back if those came back where they were.
        Returns which of (decode, prefill) graphs this rank now holds: the ranks of a sharded engine must agree, as
        a graph captured on one rank only would leave the others out of its collectives (`drop_graphs`)."""
        addresses = self._baked_addresses()
        self.decode_graphs = self.parked_graphs.take(addresses) or self.decode_graphs
        self.prefill_graphs = self.parked_prefill_graphs.take(addresses) or self.prefill_graphs
        return self.decode_graphs is not None, self.prefill_graphs is not None

    @every_rank
    def drop_graphs(self) -> None:
        """Forget the decode and prefill graphs (the next steps capture anew, on every rank together)."""
        self.decode_graphs = self.prefill_graphs = None

    @every_rank
    def clear_parked_graphs(self) -> None:
        self.parked_graphs.clear()
        self.parked_prefill_graphs.clear()

    def _baked_addresses(self) -> tuple[int, ...]:
        return baked_addresses(self.model, self.kv_cache, self.routed_experts)

    def read_routed_experts(self, block_table: list[int], num_positions: int) -> np.ndarray:
        """The routing recorded for positions [0, num_positions) of a sequence holding `block_table`, in SGLang's
        layout: [num_positions, num_hidden_layers, top_k] int32, zeros in the dense layers' rows (SGLang's capture
        buffer is zero-filled and only MoE layers write it; the cache here holds the MoE layers only). One host sync."""
        positions = np.arange(num_positions)
        slots = np.asarray(block_table, dtype=np.int64)[positions // self.block_size] * self.block_size
        slots += positions % self.block_size
        moe_rows = self.routed_experts[self.staging.to_device(slots)].cpu().numpy()
        c = self.model_config
        if len(c.moe_layers) == c.num_hidden_layers:
            return moe_rows
        rows = np.zeros((num_positions, c.num_hidden_layers, moe_rows.shape[-1]), dtype=np.int32)
        rows[:, list(c.moe_layers)] = moe_rows
        return rows

    @every_rank
    def release_weights(self, discard_names: set[str] | None = None) -> None:
        """Free the parameters' device storage, copied to the host first unless discarded: `discard_names` are the
        checkpoint names that must all be loaded again before the weights are valid (host_weights.py)."""
        if self.host_weights.released:
            return
        self.decode_graphs = self.prefill_graphs = None  # they hold the weights' addresses
        self.host_weights.release(self.model, discard_names)
        self._empty_device_cache()

    @every_rank
    def resume_weights(self) -> None:
        self.host_weights.resume(self.model)

    def load_named_tensors(self, named_tensors) -> None:
        """Copy full HF-named tensors into the model (each parameter keeps its rank's shard). Not @every_rank: each
        rank loads its own copy of the tensors, and records its version (parallel/rank_weights.py)."""
        self.host_weights.loaded(load_weights(self.model, named_tensors))

    def load_checkpoint_dir(self, model_path: str) -> None:
        """Every weight from a checkpoint folder (each rank reads it and keeps its shard), or a ValueError. A
        trainer's folder carries no router correction bias (a buffer, never sent): the loaded one stays."""
        load_checkpoint(self.model, model_path, require_buffers=False)
        self.host_weights.loaded(set(self.host_weights.missing))

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
