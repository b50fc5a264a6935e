"""The decode graphs' parking across a memory release (cuda_graph.ParkedGraphs): the graphs come back only when
every address they bake in (each weight's, the KV cache's, the routed-experts record's) is the same after the resume,
and leave the parking either way; a release of the `cuda_graph` tag drops them, and so does any release where the
memory would not come back at the same addresses (no arena: the CPU, or a driver that refuses). The graphs run on
CUDA only (the marked test here, and tests/backends/test_handover_gpu.py generating through kept graphs)."""

from __future__ import annotations

import pytest
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


def test_engine_without_stable_addresses_drops_its_graphs_at_a_release(tmp_path):
    """Where the weights and KV cache would come back elsewhere (here the CPU: no arena), parking would only hold
    the graphs' memory through the trainer's turn: a release without the cuda_graph tag drops them too."""
    engine = Engine(str(build_tiny_model(tmp_path / "m", arch="qwen3")), device="cpu", num_kvcache_blocks=64)
    runner = engine.model_runner
    assert not runner.host_weights.stable and not runner.kv_storage.stable
    runner.decode_graphs = Graphs()  # what a CUDA decode step leaves (CPU engines run no graphs)
    engine.release_memory(["weights", "kv_cache"], discard_weights=True)
    assert runner.decode_graphs is None and runner.parked_graphs.graphs is None
    engine.resume_memory(["weights", "kv_cache", "cuda_graph"])
    assert runner.decode_graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_parks_its_graphs_only_while_their_memory_and_addresses_stay(tmp_path, monkeypatch):
    """On CUDA with an arena: a release without the cuda_graph tag parks the graphs and the resume takes them back;
    with the cuda_graph tag they go. Without an arena (the driver refusing, forced here) they are dropped at the
    release, and the engine still generates what it did, capturing what it needs."""
    from slime.engine import device_arena

    path = str(build_tiny_model(tmp_path / "m", arch="qwen3"))
    prompts, greedy = [[1, 2, 3, 4], list(range(5, 30))], {"temperature": 0.0, "max_new_tokens": 16}
    engine = Engine(path, device="cuda", num_kvcache_blocks=64)
    expected = engine.generate(prompts, greedy)
    runner = engine.model_runner
    graphs = runner.decode_graphs
    engine.release_memory(["weights", "kv_cache"])
    assert runner.decode_graphs is None and runner.parked_graphs.graphs is graphs
    engine.resume_memory(["weights"])
    assert runner.parked_graphs.graphs is graphs  # the KV cache is still released: nothing decided yet
    engine.resume_memory(["kv_cache"])
    assert runner.decode_graphs is graphs
    engine.release_memory(None)  # every tag, cuda_graph among them
    assert runner.decode_graphs is None and runner.parked_graphs.graphs is None
    engine.resume_memory(None)
    assert [o["output_ids"] for o in engine.generate(prompts, greedy)] == [o["output_ids"] for o in expected]

    monkeypatch.setattr(device_arena, "arena_supported", lambda device: False)
    fallback = Engine(path, device="cuda", num_kvcache_blocks=64)
    assert not fallback.model_runner.host_weights.stable and not fallback.model_runner.kv_storage.stable
    assert fallback.model_runner.decode_graphs is not None
    fallback.release_memory(["weights", "kv_cache"])
    assert fallback.model_runner.decode_graphs is None and fallback.model_runner.parked_graphs.graphs is None
    fallback.resume_memory(None)
    assert [o["output_ids"] for o in fallback.generate(prompts, greedy)] == [o["output_ids"] for o in expected]
