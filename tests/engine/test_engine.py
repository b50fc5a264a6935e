"""Continuous batching through the real engine on a tiny Llama: preemption by recompute when KV blocks run out,
chunked prefill under a small token budget, and prefix-cache hits all give the same greedy tokens and log-probs
as an unconstrained run."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.greedy_margin import assert_clear_greedy_margin

PROMPTS = [[10 + i, 20, 30 + i, 40, 50, 60 + i, 70] for i in range(4)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def reference(path):
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128)
    outputs = [engine.generate([prompt], GREEDY)[0] for prompt in PROMPTS]
    # The other tests reach the same tokens through other batch shapes: only equal when no step is a near-tie.
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, output in zip(PROMPTS, outputs):
        assert_clear_greedy_margin(hf, prompt, output["output_ids"])
    return outputs


def assert_same(outputs, reference):
    for output, expected in zip(outputs, reference):
        assert output["output_ids"] == expected["output_ids"]
        assert output["output_log_probs"] == pytest.approx(expected["output_log_probs"], abs=1e-4)
        assert output["finish_reason"] == {"type": "length", "length": 20}


def test_preemption_by_recompute_keeps_outputs(path, reference):
    # 4 sequences of 27 tokens need 28 blocks of 4; only 12 exist.
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=12)
    rids = [engine.add_request(prompt, GREEDY) for prompt in PROMPTS]
    num_preemptions, finished = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.rid] = output.to_dict()
        num_preemptions = max(num_preemptions, sum(s.num_preemptions for s in engine.requests.values()))
    assert num_preemptions > 0
    assert_same([finished[rid] for rid in rids], reference)
    assert engine.block_manager.num_free_blocks == 12


def test_chunked_prefill_keeps_outputs(path, reference):
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=5)
    assert_same(engine.generate(PROMPTS, GREEDY), reference)


def test_prefix_cache_hits_keep_outputs(path, reference):
    engine = Engine(str(path), device="cpu", kvcache_block_size=2, num_kvcache_blocks=256)
    engine.generate(PROMPTS, GREEDY)
    outputs = engine.generate(PROMPTS, GREEDY)
    assert all(output["cached_tokens"] == 6 for output in outputs)
    assert_same(outputs, reference)


def test_step_outputs_are_snapshots_of_their_step(path, reference):
    # Outputs are built in O(1) and read lazily; each must still show the tokens, log-probs and text of its step.
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=128)
    rid = engine.add_request(PROMPTS[0], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    expected = reference[0]
    assert [o.num_completion_tokens for o in outputs] == list(range(1, 21))
    for step, output in enumerate(outputs, start=1):
        assert output.rid == rid and output.prompt_token_ids == PROMPTS[0]
        assert output.output_token_ids == expected["output_ids"][:step]
        assert output.output_log_probs == pytest.approx(expected["output_log_probs"][:step], abs=1e-4)
        assert output.text == engine.tokenizer.decode(expected["output_ids"][:step], skip_special_tokens=True)
        assert output.finished == (step == 20)
