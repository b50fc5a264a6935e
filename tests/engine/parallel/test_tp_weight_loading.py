"""Weights pushed into a sharded model: at TP=2 (and TP=2 x EP=2), `load_weights` of changed FULL tensors (q/k/v,
o_proj and their biases, gate/up/down, the embedding, the LM head, a norm, the router, experts of both EP blocks)
gives every rank exactly what a fresh TP=2 model built on the changed checkpoint holds: equal logits (bitwise) and
equal `rank_checksum`, which the push changed, and which differs between the ranks (each holds its own shard)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.engine.models.weight_loader import load_weights
from slime.engine.parallel.rank_weights import rank_checksum
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.tp_ranks import build_runner, randomize_biases_and_norms, rank_parallel, spawn_ranks

WORLD_SIZE = 2
CASES = {
    # untied, odd vocabulary (padded), q/k/v and o_proj biases, one K/V head for two ranks (replicated)
    "llama": (dict(arch="llama", attention_bias=True, tie_word_embeddings=False, embedding_size=515,
                   num_key_value_heads=1), 1),
    "qwen3_moe_ep2": (dict(arch="qwen3_moe"), 2),  # tied embedding; experts 1 and 6 sit in different EP blocks
}
CHANGED = {
    "llama": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias",
              "model.layers.1.self_attn.k_proj.bias", "model.layers.1.self_attn.o_proj.weight",
              "model.layers.1.self_attn.o_proj.bias", "model.layers.0.mlp.gate_proj.weight",
              "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight",
              "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"],
    "qwen3_moe_ep2": ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.1.gate_proj.weight",
                      "model.layers.1.mlp.experts.6.down_proj.weight", "model.layers.1.mlp.experts.6.up_proj.weight",
                      "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"],
}


def _logits(runner):
    seqs = [Sequence("a", [5, 3, 9, 200, 17, 4], SamplingParams(), 0), Sequence("b", [1, 2, 3], SamplingParams(), 0)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * 4, i * 4 + 4))
    return runner.forward_logits([ScheduledSequence(seq, 0, len(seq), True) for seq in seqs])


def _worker(rank, world_size, paths, out_dir):
    for case, (_, ep_size) in CASES.items():
        parallel = rank_parallel(rank, world_size, ep_size)
        pushed = build_runner(paths[case], parallel)
        before = rank_checksum(pushed.model)
        changed = {name: tensor for name, tensor in load_file(str(Path(paths[f"{case}_changed"]) / "model.safetensors"))
                   .items() if name in CHANGED[case]}
        loaded = load_weights(pushed.model, changed.items())
        fresh = build_runner(paths[f"{case}_changed"], parallel)
        torch.save({"loaded": loaded, "before": before, "pushed": rank_checksum(pushed.model),
                    "fresh": rank_checksum(fresh.model), "pushed_logits": _logits(pushed),
                    "fresh_logits": _logits(fresh)}, Path(out_dir) / f"{case}.rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_weights")
    paths = {}
    for case, (overrides, _) in CASES.items():
        path = build_tiny_model(root / case, initializer_range=0.3, **overrides)
        randomize_biases_and_norms(path)
        changed = root / f"{case}_changed"
        shutil.copytree(path, changed)
        tensors = load_file(str(changed / "model.safetensors"))
        generator = torch.Generator().manual_seed(1)
        for name in CHANGED[case]:
            tensors[name] = tensors[name] + 0.2 * torch.randn(tensors[name].shape, generator=generator)
        save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
        assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] == (case != "llama")
        paths[case], paths[f"{case}_changed"] = str(path), str(changed)
    out_dir = root / "out"
    out_dir.mkdir()
    spawn_ranks(_worker, WORLD_SIZE, paths, str(out_dir))
    return out_dir


@pytest.mark.parametrize("case", list(CASES))
def test_pushed_full_tensors_equal_a_fresh_model_on_the_changed_checkpoint(results, case):
    ranks = [torch.load(results / f"{case}.rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    for rank, got in enumerate(ranks):
        assert got["loaded"] == set(CHANGED[case]), rank
        assert got["pushed"] == got["fresh"] != got["before"], rank
        assert torch.equal(got["pushed_logits"], got["fresh_logits"]), rank
    assert ranks[0]["fresh"] != ranks[1]["fresh"]  # each rank holds its own shard
    assert torch.equal(ranks[0]["pushed_logits"], ranks[1]["pushed_logits"])
