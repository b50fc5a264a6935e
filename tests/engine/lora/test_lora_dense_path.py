"""LoRA's dense path (engine/lora/slots.py: static shapes and a one-hot slot row per token, what the decode CUDA
graphs capture) gives the segmented path's hidden states for a batch mixing two adapters and the base model, on the
CPU where both run eagerly."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from slime.engine.engine import Engine
from slime.engine.lora.adapter import adapter_from_tensors
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.lora_adapters import random_adapter


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.5)


def test_dense_path_equals_segmented_path(path):
    hf_config = AutoConfig.from_pretrained(str(path))
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64, enable_lora=True,
                    max_lora_rank=8, max_loras_per_batch=3, max_num_seqs=32)
    for name, (rank, seed, targets) in {"one": (8, 1, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj")),
                                        "two": (2, 2, ("v_proj", "up_proj"))}.items():
        config, tensors = random_adapter(hf_config, rank=rank, alpha=2 * rank, seed=seed, targets=targets)
        engine.load_lora_adapter(name, adapter_from_tensors(config, tensors.items(), 8))
    runner = engine.model_runner
    registry = runner.lora_registry
    slots = np.array([registry.adapters["one"].slot, -1, registry.adapters["two"].slot,
                      registry.adapters["one"].slot, -1, registry.adapters["two"].slot])
    items = []
    for index, slot in enumerate(slots):
        seq = Sequence(str(index), [7 + index, 20, 33, 41, 52], SamplingParams(), 0)
        seq.block_table, seq.lora_slot = [2 * index, 2 * index + 1], int(slot)
        items.append(ScheduledSequence(seq, 0, 5, True))

    def hidden(mode: str) -> torch.Tensor:
        with torch.inference_mode():
            input_ids, positions, meta, _ = runner.prepare_inputs(items)  # the segmented path's batch
            if mode == "dense":
                runner.lora.set_graph_rows(np.repeat(slots, 5))
            elif mode == "base":
                runner.lora.set_batch(np.full(len(input_ids), -1))
            return runner.model(input_ids, positions, meta).clone()

    segmented, dense = hidden("segmented"), hidden("dense")
    assert runner.lora.dense is True  # the forward above went through the dense path
    base = hidden("base")
    torch.testing.assert_close(dense, segmented, atol=1e-5, rtol=1e-5)
    base_rows = np.repeat(slots, 5) == -1
    torch.testing.assert_close(segmented[base_rows], base[base_rows], atol=1e-6, rtol=1e-6)
    assert (segmented[~base_rows] - base[~base_rows]).abs().max() > 0.1  # the adapters change what they touch
