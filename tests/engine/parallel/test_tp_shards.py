"""What each rank of a TP=2 or TP=4 engine holds of a checkpoint, checked against the checkpoint's own tensors (no
processes: building and loading a shard runs no collective): the ranks' q rows, gate / up rows, o_proj / down_proj
columns and vocabulary rows put side by side give the full HF tensors back; a K/V head shared by several ranks is
held whole by each (rank r holds head r * num_kv_heads // tp_size); vocabulary padding is zeros; experts are split
by EP block and intermediate slice; the router, norms and row-parallel biases are held whole; a checkpoint's own
fused gate_up_proj (GLM-4) is split by gate and up rows. `named_weight_shapes` reports the full HF shapes on every
rank."""

import pytest
import torch

from slime.engine.models import DecoderForCausalLM, load_model_config
from slime.engine.models.weight_loader import iterate_checkpoint, load_checkpoint, named_weight_shapes
from slime.engine.parallel.rank_weights import rank_checksum
from slime.engine.parallel.state import ParallelState
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.tp_ranks import randomize_biases_and_norms

CHECKPOINTS = {
    "llama": dict(arch="llama", attention_bias=True, tie_word_embeddings=False, embedding_size=515,
                  num_key_value_heads=1),
    "llama_kv2": dict(arch="llama", attention_bias=True, tie_word_embeddings=False, embedding_size=515,
                      num_attention_heads=8, num_key_value_heads=2),
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for name, overrides in CHECKPOINTS.items():
        paths[name] = build_tiny_model(tmp_path_factory.mktemp(name), **overrides)
        randomize_biases_and_norms(paths[name])
    return paths


def rank_models(path, ep_size=1, tp_size=2):
    config = load_model_config(str(path))
    models = []
    for rank in range(tp_size):
        model = DecoderForCausalLM(config, ParallelState(rank, tp_size, ep_size))
        load_checkpoint(model, path)
        models.append(model)
    return config, models, dict(iterate_checkpoint(path))


@pytest.mark.parametrize("name, tp_size, ep_size",
                         [("llama", 2, 1), ("llama_kv2", 4, 1), ("qwen2_moe", 2, 1), ("qwen2_moe", 4, 2)])
def test_named_weight_shapes_are_the_full_hf_shapes(checkpoints, name, tp_size, ep_size):
    _, models, full = rank_models(checkpoints[name], ep_size, tp_size)
    expected = {weight: tuple(tensor.shape) for weight, tensor in full.items()}
    for model in models:
        assert {weight: shape for weight, (shape, _) in named_weight_shapes(model).items()} == expected


@pytest.mark.parametrize("name, tp_size", [("llama", 2), ("llama_kv2", 4)])
def test_dense_shards_reassemble_the_checkpoint(checkpoints, name, tp_size):
    config, ranks, full = rank_models(checkpoints[name], tp_size=tp_size)
    head_dim, num_kv_heads = config.head_dim, config.num_key_value_heads
    assert num_kv_heads < tp_size  # K/V heads replicated: 1 head on 2 ranks, or 2 heads on 4 ranks
    q_rows, kv_rows = config.num_attention_heads // tp_size * head_dim, head_dim
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}"
        attention = [model.model.layers[index].self_attn for model in ranks]
        for param in ("weight", "bias"):
            qkv = [getattr(attn.qkv_proj, param) for attn in attention]
            assert torch.equal(torch.cat([t[:q_rows] for t in qkv]), full[f"{prefix}.self_attn.q_proj.{param}"])
            for rank, t in enumerate(qkv):
                head = rank * num_kv_heads // tp_size  # each K/V head on tp_size / num_kv_heads consecutive ranks
                rows = slice(head * head_dim, (head + 1) * head_dim)
                assert torch.equal(t[q_rows : q_rows + kv_rows], full[f"{prefix}.self_attn.k_proj.{param}"][rows])
                assert torch.equal(t[q_rows + kv_rows :], full[f"{prefix}.self_attn.v_proj.{param}"][rows])
        assert torch.equal(torch.cat([attn.o_proj.weight for attn in attention], dim=1),
                           full[f"{prefix}.self_attn.o_proj.weight"])
        for attn in attention:  # added once, after the all-reduce
            assert torch.equal(attn.o_proj.bias, full[f"{prefix}.self_attn.o_proj.bias"])
        mlps = [model.model.layers[index].mlp for model in ranks]
        rows = config.intermediate_size // tp_size
        for half, projection in enumerate(("gate_proj", "up_proj")):
            assert torch.equal(torch.cat([mlp.gate_up_proj.weight[half * rows : (half + 1) * rows] for mlp in mlps]),
                               full[f"{prefix}.mlp.{projection}.weight"])
        assert torch.equal(torch.cat([mlp.down_proj.weight for mlp in mlps], dim=1),
                           full[f"{prefix}.mlp.down_proj.weight"])
        for model in ranks:
            norm = model.model.layers[index].input_layernorm
            assert torch.equal(norm.weight, full[f"{prefix}.input_layernorm.weight"])
    vocab = config.vocab_size
    padded = -(-vocab // tp_size) * tp_size
    assert padded > vocab  # 515 rows: padded to 516
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.cat([model.get_parameter(name) for model in ranks])
        assert rows.shape[0] == padded
        assert torch.equal(rows[:vocab], full[name]) and not rows[vocab:].any()  # padding rows are zeros
    checksums = [rank_checksum(model) for model in ranks]
    assert len(set(checksums)) == tp_size  # each rank holds its own shard


@pytest.mark.parametrize("tp_size, ep_size", [(2, 1), (2, 2), (4, 2)])
def test_expert_shards_reassemble_the_checkpoint(checkpoints, tp_size, ep_size):
    config, ranks, full = rank_models(checkpoints["qwen2_moe"], ep_size, tp_size)
    num_local, moe_tp = config.num_experts // ep_size, tp_size // ep_size
    rows = config.moe_intermediate_size // moe_tp
    for index in config.moe_layers:
        prefix = f"model.layers.{index}.mlp"
        blocks = [model.model.layers[index].mlp for model in ranks]
        for rank, block in enumerate(blocks):
            ep_rank, moe_tp_rank = rank // moe_tp, rank % moe_tp
            assert block.experts.gate_up_proj.shape[0] == num_local
            for local in range(num_local):
                expert = f"{prefix}.experts.{ep_rank * num_local + local}"
                part = slice(moe_tp_rank * rows, (moe_tp_rank + 1) * rows)
                gate_up = block.experts.gate_up_proj[local]
                assert torch.equal(gate_up[:rows], full[f"{expert}.gate_proj.weight"][part])
                assert torch.equal(gate_up[rows:], full[f"{expert}.up_proj.weight"][part])
                assert torch.equal(block.experts.down_proj[local], full[f"{expert}.down_proj.weight"][:, part])
            assert torch.equal(block.gate.weight, full[f"{prefix}.gate.weight"])  # the router, replicated
            assert torch.equal(block.shared_expert_gate.weight, full[f"{prefix}.shared_expert_gate.weight"])
        shared_rows = config.shared_expert_intermediate_size // tp_size  # over all ranks, like a dense MLP
        assert torch.equal(torch.cat([b.shared_expert.gate_up_proj.weight[:shared_rows] for b in blocks]),
                           full[f"{prefix}.shared_expert.gate_proj.weight"])
        assert torch.equal(torch.cat([b.shared_expert.down_proj.weight for b in blocks], dim=1),
                           full[f"{prefix}.shared_expert.down_proj.weight"])


def test_a_checkpoints_fused_gate_up_is_split_by_gate_and_up_rows(tmp_path):
    """GLM-4 checkpoints hold `mlp.gate_up_proj.weight` = [gate; up] already fused: rank r takes its rows of each."""
    path = build_tiny_model(tmp_path, arch="glm4")
    config, ranks, full = rank_models(path)
    rows = config.intermediate_size // 2
    for index in range(config.num_hidden_layers):
        name = f"model.layers.{index}.mlp.gate_up_proj.weight"
        gate, up = full[name].chunk(2)
        local = [model.get_parameter(name) for model in ranks]
        assert torch.equal(torch.cat([t[:rows] for t in local]), gate)
        assert torch.equal(torch.cat([t[rows:] for t in local]), up)
    for model in ranks:
        assert {n: shape for n, (shape, _) in named_weight_shapes(model).items()} == {
            n: tuple(t.shape) for n, t in full.items()}
