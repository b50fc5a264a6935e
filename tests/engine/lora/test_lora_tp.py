"""LoRA on a sharded engine: two ranks (rank 0 here, rank 1 a spawned child over gloo) hold their shards of every
adapter slot (q/k/v and gate/up B by output rows, o/down A by input columns, the low-rank products of a row-parallel
layer summed over the ranks) and give the one-rank engine's tokens and log-probs (< 1e-5, fp32) with the same
adapters, in one batch mixing two adapters and the base model; with K/V heads replicated over the ranks too; a
reload into a reused slot reaches every rank."""

import pytest
import torch
from transformers import AutoConfig

from slime.engine.engine import Engine
from slime.engine.lora.adapter import adapter_from_tensors
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.lora_adapters import random_adapter

PROMPTS = [[10 + i, 20, 30 + i, 40, 50, 60 + i, 70, 80, 90] for i in range(3)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
NAMES = ["one", "two", None]


@pytest.fixture(scope="module", params=[{}, {"num_key_value_heads": 1}], ids=["gqa", "one_kv_head"])
def path(tmp_path_factory, request):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.5, seed=3,
                            **request.param)


def adapters(path):
    hf_config = AutoConfig.from_pretrained(str(path))
    return {"one": random_adapter(hf_config, rank=4, alpha=8, seed=1),
            "two": random_adapter(hf_config, rank=2, alpha=4, seed=2, targets=("q_proj", "v_proj", "down_proj")),
            "three": random_adapter(hf_config, rank=8, alpha=8, seed=4, targets=("k_proj", "o_proj", "up_proj"))}


def make_engine(path, tp_size):
    return Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128, enable_lora=True,
                  max_lora_rank=8, max_loras_per_batch=2, tp_size=tp_size)


def load(engine, name, adapter):
    config, tensors = adapter
    engine.load_lora_adapter(name, adapter_from_tensors(config, tensors.items(), engine.config.max_lora_rank))


def run_mixed(engine, names):
    """Every prompt under every adapter name, all in one batch: {(prompt index, name): result}."""
    rids = {engine.add_request(prompt, GREEDY, incremental=False, lora_name=name): (i, name)
            for i, prompt in enumerate(PROMPTS) for name in names}
    results = {}
    while len(results) < len(rids):
        for output in engine.step():
            if output.finished:
                results[rids[output.rid]] = output.to_dict()
    return results


def assert_same(sharded: dict, single: dict) -> None:
    for key, expected in single.items():
        assert sharded[key]["output_ids"] == expected["output_ids"], key
        torch.testing.assert_close(torch.tensor(sharded[key]["output_log_probs"]),
                                   torch.tensor(expected["output_log_probs"]), rtol=0, atol=1e-5)


def test_two_ranks_serve_adapters_as_one_rank(path):
    pushed = adapters(path)
    results = {}
    for tp_size in (1, 2):
        engine = make_engine(path, tp_size)
        try:
            for name in ("one", "two"):
                load(engine, name, pushed[name])
            first = run_mixed(engine, NAMES)
            engine.unload_lora_adapter("one")  # its slot is reused: every rank must get the new adapter
            load(engine, "three", pushed["three"])
            engine.flush_cache()
            results[tp_size] = first, run_mixed(engine, ["three", "two"])
        finally:
            engine.shutdown()
    for sharded, single in zip(results[2], results[1]):
        assert_same(sharded, single)
    # the adapters act: each one's tokens or log-probs differ from the base model's
    first = results[1][0]
    for name in ("one", "two"):
        assert any(first[(i, name)]["output_log_probs"] != pytest.approx(first[(i, None)]["output_log_probs"],
                                                                        abs=1e-3) for i in range(len(PROMPTS)))
