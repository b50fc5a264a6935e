"""The eval rollout against a real engine: --eval-* sampling parameters and per-dataset results, and slime's
--eval-config giving each dataset its own settings. Fixtures and helpers are test_rollout.py's (one tiny model
behind a real sglang-router)."""

import json

import pytest

from slime.rollout.dataset import load_tokenizer
from slime.rollout.generate_request import build_sampling_params
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.eval_config import resolve_eval_datasets
from slime.utils.types import Sample
from tests.rollout.test_sglang_rollout import make_args, reference_log_probs, stack  # noqa: F401 (fixtures)


def test_eval_uses_eval_params_and_returns_per_dataset_results(make_args, tmp_path, stack):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({"input": "1 + 1", "label": "2"}) + "\n")
    second.write_text("".join(json.dumps({"input": f"{i} + 2", "label": str(i + 2)}) + "\n" for i in range(2)))
    args = make_args(
        ["unused"], rollout_temperature=1.0, eval_prompt_data=["a", str(first), "b", str(second)],
        n_samples_per_eval_prompt=3, eval_temperature=0.5, eval_max_response_len=2, eval_top_p=None, eval_top_k=None,
    )
    args.eval_datasets = resolve_eval_datasets(args)  # as validation derives them from the fields set above
    assert build_sampling_params(args, evaluation=True)["temperature"] == 0.5
    results = generate_rollout(args, 0, None, evaluation=True)
    assert sorted(results) == ["a", "b"]
    assert len(results["a"]["rewards"]) == 3 and len(results["b"]["samples"]) == 6
    assert [s.group_index for s in results["b"]["samples"]] == [0, 0, 0, 1, 1, 1]
    eos = load_tokenizer(stack.model_dir).convert_tokens_to_ids("<|im_end|>")
    for name in ("a", "b"):
        samples = results[name]["samples"]
        assert results[name]["truncated"] == [s.status == Sample.Status.TRUNCATED for s in samples]
        for sample in samples:
            assert 1 <= sample.response_length <= 2  # eval_max_response_len, not the rollout's
            if sample.status == Sample.Status.TRUNCATED:
                assert sample.response_length == 2
            else:
                assert sample.status == Sample.Status.COMPLETED and sample.tokens[-1] == eos
            # the engine's log-probs are log_softmax(logits / 0.5): eval_temperature reached the engine
            at_eval = reference_log_probs(stack.model_dir, sample.tokens, sample.response_length, 0.5)
            at_rollout = reference_log_probs(stack.model_dir, sample.tokens, sample.response_length, 1.0)
            assert sample.rollout_log_probs == pytest.approx(at_eval, abs=2e-3)
            assert max(abs(a - b) for a, b in zip(at_eval, at_rollout)) > 1e-2
    assert results["b"]["rewards"] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # reward_by_index on eval indices


def test_eval_config_gives_each_dataset_its_own_settings(make_args, tmp_path, stack):
    """--eval-config (slime's YAML): per-dataset sampling, sample count, row keys and rm_type; defaults fill in."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({"input": "1 + 1", "label": "2"}) + "\n")
    second.write_text(json.dumps({"question": "2 + 2", "answer": "4"}) + "\n")
    config = tmp_path / "eval.yaml"
    config.write_text(f"""
eval:
  defaults: {{max_response_len: 2, n_samples_per_eval_prompt: 2}}
  datasets:
    - {{name: short, path: {first}, temperature: 0.5}}
    - {{name: long, path: {second}, max_response_len: 4, n_samples_per_eval_prompt: 1, input_key: question,
       label_key: answer, rm_type: math, metadata_overrides: {{source: b}}}}
""")
    args = make_args(["unused"], rollout_temperature=1.0, eval_config=str(config), eval_prompt_data=None,
                     n_samples_per_eval_prompt=3, custom_rm_path=None, rm_type="math")
    args.eval_datasets = resolve_eval_datasets(args)  # as validation derives them from the fields set above
    results = generate_rollout(args, 0, None, evaluation=True)
    short, long = results["short"]["samples"], results["long"]["samples"]
    assert len(short) == 2 and len(long) == 1
    assert all(1 <= s.response_length <= 2 for s in short) and 1 <= long[0].response_length <= 4
    assert long[0].prompt == "2 + 2" and long[0].label == "4"
    assert long[0].metadata["rm_type"] == "math" and long[0].metadata["source"] == "b"
    for sample in short:  # temperature 0.5 reached the engine for this dataset only
        at_half = reference_log_probs(stack.model_dir, sample.tokens, sample.response_length, 0.5)
        assert sample.rollout_log_probs == pytest.approx(at_half, abs=2e-3)
    at_one = reference_log_probs(stack.model_dir, long[0].tokens, long[0].response_length, 1.0)
    assert long[0].rollout_log_probs == pytest.approx(at_one, abs=2e-3)
