"""GPU check of the Transformer Engine names (skipped without CUDA and Transformer Engine): a model built with TE's
layer spec on the GPU (what slime's Megatron builds) saves a Megatron-LM checkpoint whose weight entries are exactly
those the local spec on the CPU writes and reads (checkpoint.py's name mapping), and each backend's model loads the
other's checkpoint to the same HF weights, a dense and an MoE model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.fsdp_helpers import make_args, run_distributed
from tests.helpers.megatron_helpers import build_chunks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="needs Transformer Engine")]
pytest.importorskip("megatron.core")


def _weight_keys(folder) -> set[str]:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return {key for key in load_tensors_metadata(str(folder)) if not key.endswith("_extra_state")}


def _te_and_local(rank, world_size, port, checkpoint, tmp):
    from transformers import AutoConfig

    from slime.backends.megatron_utils import checkpoint as torch_dist
    from slime.backends.megatron_utils.hf_weights import model_hf_weights
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.process_group import init_default_group

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    torch.cuda.set_device(cuda)
    args = make_args(checkpoint, "--train-backend", "megatron", device="cuda")
    init_default_group(cuda, rank, world_size, "127.0.0.1", port)
    init_model_parallel(args, cuda)
    hf_config = AutoConfig.from_pretrained(checkpoint)
    te_chunks, local_chunks = build_chunks(args, hf_config, cuda), build_chunks(args, hf_config, cpu)
    assert "TELayerNormColumnParallelLinear" in type(te_chunks[0].decoder.layers[0].self_attention.linear_qkv).__name__
    torch_dist.save_weights(tmp / "te", te_chunks, args, hf_config)
    torch_dist.save_weights(tmp / "local", local_chunks, args, hf_config)
    te_keys, local_keys = _weight_keys(tmp / "te" / "release"), _weight_keys(tmp / "local" / "release")
    exported = {name: tensor.float().cpu() for name, tensor in model_hf_weights(te_chunks, hf_config)}
    for chunk in local_chunks:  # scrambled, so the load must bring every weight back
        for param in chunk.parameters():
            param.data.normal_()
    torch_dist.load_model_weights(tmp / "te", local_chunks)
    from_te = {name: tensor.float() for name, tensor in model_hf_weights(local_chunks, hf_config)}
    for chunk in te_chunks:
        for param in chunk.parameters():
            param.data.normal_()
    torch_dist.load_model_weights(tmp / "local", te_chunks)
    from_local = {name: tensor.float().cpu() for name, tensor in model_hf_weights(te_chunks, hf_config)}
    return te_keys, local_keys, exported, from_te, from_local


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_te_spec_and_local_spec_checkpoints_are_the_same_entries(tmp_path, arch):
    from slime.utils.tiny_model import build_tiny_model

    checkpoint = build_tiny_model(tmp_path / arch, arch=arch, seed=6, vocab_size=300, tie_word_embeddings=False)
    te_keys, local_keys, exported, from_te, from_local = run_distributed(_te_and_local, 1, checkpoint, tmp_path)[0]
    assert te_keys == local_keys
    assert set(from_te) == set(exported) == set(from_local)
    for name, tensor in exported.items():
        assert torch.equal(from_te[name], tensor) and torch.equal(from_local[name], tensor), name
