"""The decode graphs' parking across a memory release (cuda_graph.ParkedGraphs): the graphs come back only when
every address they bake in (each weight's, the KV cache's, the routed-experts record's) is the same after the resume,
and leave the parking either way; a release of the `cuda_graph` tag drops them. The graphs themselves run on CUDA
only (tests/test_handover_gpu.py generates through kept graphs); here the bookkeeping, on the engine's real model."""

from __future__ import annotations

import torch

from slime.engine.cuda_graph import ParkedGraphs, baked_addresses
from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model


class Graphs:  # stands for a DecodeGraphs: parking only holds and returns it
    pass


def test_graphs_come_back_only_at_the_same_addresses():
    parked, graphs = ParkedGraphs(), Graphs()
    parked.park(graphs, (1, 2, 3))
    assert parked.take((1, 2, 3)) is graphs
    assert parked.take((1, 2, 3)) is None  # taken: the parking is empty
    parked.park(graphs, (1, 2, 3))
    assert parked.take((1, 2, 4)) is None  # the KV cache moved
    assert parked.graphs is None  # dropped with the mismatch, not kept for later


def test_baked_addresses_cover_every_weight_and_the_given_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    cache = torch.empty(4)
    addresses = baked_addresses(model, cache, None)
    assert addresses == (*(p.data_ptr() for p in model.parameters()), cache.data_ptr(), 0)
    model[1].weight.data = torch.empty(1, 3)  # a weight re-allocated elsewhere changes the key
    assert baked_addresses(model, cache, None) != addresses


def test_engine_parks_its_graphs_unless_the_release_frees_their_memory(tmp_path):
    engine = Engine(str(build_tiny_model(tmp_path / "m", arch="qwen3")), device="cpu", num_kvcache_blocks=64)
    runner = engine.model_runner
    graphs = Graphs()
    runner.decode_graphs = graphs  # what a CUDA decode step leaves (CPU engines run no graphs)
    engine.release_memory(["weights", "kv_cache"], discard_weights=True)
    assert runner.decode_graphs is None and runner.parked_graphs.graphs is graphs  # not usable while released
    engine.resume_memory(["weights"])
    assert runner.parked_graphs.graphs is graphs  # the KV cache is still released: nothing decided yet
    engine.resume_memory(["kv_cache", "cuda_graph"])
    # the resume decides by the addresses: here the discarded weights came back as one new flat allocation
    assert runner.parked_graphs.graphs is None
    assert runner.decode_graphs is None
    runner.decode_graphs = graphs
    engine.release_memory(None)  # every tag, cuda_graph among them: the graphs' memory goes too
    assert runner.decode_graphs is None and runner.parked_graphs.graphs is None
    engine.resume_memory(None)
    assert runner.decode_graphs is None
