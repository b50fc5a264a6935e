"""The engine's per-sequence state under true_on_policy: a weight update while a sequence is generating makes the
engine recompute its prefix under the new weights (the tokens sampled afterwards carry the new policy's log-probs,
bit for bit the trainer's), finished sequences leave no state behind, and the result does not depend on how many
threads torch uses (the engine and the trainer run in different processes)."""

import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from tests.engine.true_on_policy.test_engine_matches_trainer import SAMPLING, trainer_log_probs
from tests.helpers.lora_helpers import wide_tiny_checkpoint

PROMPT = [5, 17, 30, 41, 50, 61, 77, 90, 12, 33, 45]


def test_weight_update_mid_sequence_recomputes_under_the_new_weights(tmp_path):
    old = wide_tiny_checkpoint(tmp_path / "old")
    model = AutoModelForCausalLM.from_pretrained(str(old), dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    new = tmp_path / "new"
    model.save_pretrained(new, safe_serialization=True)

    engine = Engine(str(old), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64, true_on_policy=True)
    rid = engine.add_request(PROMPT, dict(SAMPLING, sampling_seed=3), incremental=False)
    for _ in range(6):
        engine.step()
    seq = engine.requests[rid]
    num_before = len(seq.token_ids) - seq.num_prompt_tokens
    assert 0 < num_before < SAMPLING["max_new_tokens"]
    engine.update_weights_from_tensors([(name, tensor) for name, tensor in model.state_dict().items()])
    output = None
    while engine.has_unfinished_requests():
        for step_output in engine.step():
            if step_output.finished:
                output = step_output.to_dict()
    assert engine.model_runner.true_on_policy.states == {}  # finished: its state is gone
    sequence = PROMPT + output["output_ids"]
    after_update = torch.tensor(output["output_log_probs"][num_before:], dtype=torch.float64)
    expected, _ = trainer_log_probs(new, [sequence], [len(PROMPT) + num_before], SAMPLING["temperature"])
    assert torch.equal(after_update, expected[0].double())
    stale, _ = trainer_log_probs(old, [sequence], [len(PROMPT) + num_before], SAMPLING["temperature"])
    assert not torch.equal(after_update, stale[0].double())  # the update did change them


def test_the_thread_count_does_not_change_a_bit(tmp_path):
    checkpoint = wide_tiny_checkpoint(tmp_path / "model")
    sequence = PROMPT + list(range(100, 140))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(trainer_log_probs(checkpoint, [sequence], [len(PROMPT)], 0.8)[0][0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
