"""TrajectoryManager: a session's turns -> Samples (slime.agent.trajectory), on the tiny tokenizer's chat template.

Prompts are rendered by the real template; "sampled" ids are chosen by the test (canonical tokenizations, which a
re-render reproduces, or byte-by-byte ones, which it does not: re-tokenization drift). Every test decodes the
trained and untrained spans and compares them with what was sampled and rendered. slime's own cases on synthetic
ids are tests/slime_upstream/test_trajectory_manager_branching.py.
"""

import pytest

from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.types import Sample


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from slime.utils.tiny_model import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def render(tokenizer, messages, tools=None):
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def canonical(tokenizer, text):
    """Ids a re-render of `text` reproduces, plus the end-of-turn token the engine samples."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def byte_by_byte(tokenizer, text):
    """The same text as one token per byte: decodes identically, re-tokenizes differently."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
    ids = [tokenizer.convert_tokens_to_ids(char) for piece in pieces for char in piece]
    assert len(ids) > len(pieces) and tokenizer.decode(ids) == text
    return ids + [tokenizer.eos_token_id]


def turn(prompt_ids, output_ids, first_log_prob=-0.5, **kwargs):
    log_probs = [first_log_prob - 0.01 * i for i in range(len(output_ids))]
    return TurnRecord(prompt_ids, output_ids, kwargs.pop("finish_reason", "stop"), log_probs, **kwargs)


def runs(sample, mask_value):
    """The contiguous id runs of the response whose loss mask is `mask_value`."""
    response = sample.tokens[sample.prompt_length:]
    out, current = [], []
    for token, mask in zip(response, sample.loss_mask):
        if mask == mask_value:
            current.append(token)
        elif current:
            out, current = out + [current], []
    return out + [current] if current else out


def record(manager, prompt_ids, messages, output_ids, text, sid="s", **kwargs):
    """Record one turn prompted with `messages` (rendered to `prompt_ids`) that answered `text` (sampled as
    `output_ids`); returns its TurnRecord."""
    record = turn(prompt_ids, output_ids, **kwargs)
    manager.record_turn(sid, turn=record, prompt_messages=messages,
                        response_message={"role": "assistant", "content": text})
    return record


SYSTEM = {"role": "system", "content": "Please reason step by step."}
USER = {"role": "user", "content": "What is 12 + 7?"}
BASE = Sample()


def test_multi_turn_without_drift_trains_exactly_the_sampled_ids(tokenizer):
    manager = TrajectoryManager()
    history = [SYSTEM, USER]
    sampled_texts, turns = ["The answer is 19", "The answer is \\boxed{19}", "19"], []
    for i, text in enumerate(sampled_texts):
        turns.append(record(manager, render(tokenizer, history), history, canonical(tokenizer, text), text,
                            first_log_prob=-1.0 - i, weight_version=str(i)))
        history = history + [{"role": "assistant", "content": text}, {"role": "user", "content": "Are you sure?"}]
    assert manager.turn_count("s") == 3

    [sample] = manager.get_trajectory("s", base_sample=BASE)
    assert sample.tokens == turns[-1].prompt_ids + turns[-1].output_ids
    assert sample.prompt_length == len(turns[0].prompt_ids)
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(sample, 1)] == sampled_texts
    assert [tokenizer.decode(r) for r in runs(sample, 0)] == [
        "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"] * 2
    expected_log_probs = [lp for t in turns for lp in t.output_log_probs]
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m] == expected_log_probs
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sample.weight_versions == ["0", "1", "2"] and sample.status == Sample.Status.COMPLETED
    trained_versions = [v for v, m in zip(sample.token_weight_versions, sample.loss_mask) if m]
    assert trained_versions == [str(i) for i, t in enumerate(turns) for _ in t.output_ids]
    assert all(v is None for v, m in zip(sample.token_weight_versions, sample.loss_mask) if not m)
    assert sample.session_id == "s" and sample.metadata["num_turns"] == 3 and sample.metadata["num_leaves"] == 1
    assert sample.metadata["turn_indices"] == [0, 1, 2] and sample.metadata["num_absorbed_drift_tokens"] == 0
    assert not manager.has_session("s") and manager.get_trajectory("s", base_sample=BASE) == []  # consumed


def re_tokenized_session(tokenizer, fork_threshold_tokens):
    """Turn 1 samples its answer byte by byte; turn 2's prompt re-renders it canonically."""
    manager = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
    first_prompt = render(tokenizer, [USER])
    first = record(manager, first_prompt, [USER], byte_by_byte(tokenizer, "The answer is 19"), "The answer is 19")
    history = [USER, {"role": "assistant", "content": "The answer is 19"}, {"role": "user", "content": "Why?"}]
    second_prompt = render(tokenizer, history)
    assert second_prompt[:len(first_prompt) + len(first.output_ids)] != first_prompt + first.output_ids
    second = record(manager, second_prompt, history, canonical(tokenizer, "12 + 7 = 19"), "12 + 7 = 19")
    return manager.get_trajectory("s", base_sample=BASE), first_prompt, first, second_prompt, second


def test_re_tokenized_latest_response_is_realigned_as_context_when_the_next_output_is_short(tokenizer):
    [sample], first_prompt, first, second_prompt, second = re_tokenized_session(tokenizer, 1024)
    # the drifted response is replaced by its re-rendering, as context: only turn 2 trains, in one Sample
    assert sample.tokens == second_prompt + second.output_ids and sample.prompt_length == len(first_prompt)
    assert sample.loss_mask == [0] * (len(second_prompt) - len(first_prompt)) + [1] * len(second.output_ids)
    assert sample.rollout_log_probs == [0.0] * (len(second_prompt) - len(first_prompt)) + second.output_log_probs
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(sample, 1)] == ["12 + 7 = 19"]
    assert sample.metadata["turn_indices"] == [1]
    assert sample.metadata["num_absorbed_drift_tokens"] == len(first.output_ids)


def test_re_tokenized_latest_response_forks_when_the_next_output_reaches_the_threshold(tokenizer):
    (old, new), first_prompt, first, second_prompt, second = re_tokenized_session(tokenizer, len(canonical(
        tokenizer, "12 + 7 = 19")))
    # the old Sample keeps the byte-by-byte ids the engine sampled, trained
    assert old.tokens == first_prompt + first.output_ids and old.loss_mask == [1] * len(first.output_ids)
    assert old.rollout_log_probs == first.output_log_probs and old.metadata["turn_indices"] == [0]
    # the fork is the prompt as the client rendered it (context only) plus the new output
    assert new.tokens == second_prompt + second.output_ids and new.prompt_length == len(second_prompt)
    assert new.loss_mask == [1] * len(second.output_ids) and new.metadata["turn_indices"] == [1]
    assert tokenizer.decode(runs(new, 1)[0], skip_special_tokens=True) == "12 + 7 = 19"
    assert sum(old.loss_mask) + sum(new.loss_mask) == len(first.output_ids) + len(second.output_ids)


def test_a_fork_after_shared_turns_leaves_the_shared_sampled_ids_untrained(tokenizer):
    manager = TrajectoryManager(fork_threshold_tokens=1)  # every drift in the latest response forks
    history, outputs = [USER], []
    for text, ids_of in [("The answer", canonical), ("is 19", byte_by_byte), ("19", canonical)]:
        outputs.append(ids_of(tokenizer, text))
        record(manager, render(tokenizer, history), history, outputs[-1], text)
        history = history + [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on"}]
    first_leaf, fork = manager.get_trajectory("s", base_sample=BASE)
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(first_leaf, 1)] == ["The answer", "is 19"]
    # turn 1's ids appear in the fork too (the client re-rendered them identically), as context
    start = fork.tokens.index(outputs[0][0])
    assert fork.tokens[start:start + len(outputs[0])] == outputs[0] and start < fork.prompt_length
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(fork, 1)] == ["19"]
    assert sum(first_leaf.loss_mask) + sum(fork.loss_mask) == sum(len(o) for o in outputs)


def test_a_changed_system_prompt_is_a_new_branch_whatever_the_threshold(tokenizer):
    for fork_threshold_tokens in (0, 1024):
        manager = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
        first_messages = [{"role": "system", "content": "Date: 1 2 3"}, USER]
        first_prompt = render(tokenizer, first_messages)
        output = canonical(tokenizer, "The answer is 19")
        record(manager, first_prompt, first_messages, output, "The answer is 19")
        # the client re-renders its system prompt with a new date: the message differs, so the tree branches
        history = [{"role": "system", "content": "Date: 1 2 4"}, USER,
                   {"role": "assistant", "content": "The answer is 19"}, {"role": "user", "content": "Why?"}]
        second_prompt = render(tokenizer, history)
        second = record(manager, second_prompt, history, canonical(tokenizer, "12 + 7"), "12 + 7")
        assert len(manager._trees["s"].children) == 2
        old, fork = manager.get_trajectory("s", base_sample=BASE)
        assert old.tokens == first_prompt + output and old.loss_mask == [1] * len(output)
        assert fork.tokens == second_prompt + second.output_ids and fork.prompt_length == len(second_prompt)
        assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(fork, 1)] == ["12 + 7"]
        assert [s.metadata["num_leaves"] for s in (old, fork)] == [2, 2]


def test_retried_and_parallel_calls_are_sibling_samples_of_one_rollout(tokenizer):
    manager = TrajectoryManager()
    prompt_ids = render(tokenizer, [USER])
    record(manager, prompt_ids, [USER], canonical(tokenizer, "19"), "19")
    record(manager, prompt_ids, [USER], canonical(tokenizer, "20"), "20")  # the client retried the same prompt
    history = [USER, {"role": "assistant", "content": "19"}, {"role": "user", "content": "Ok"}]
    record(manager, render(tokenizer, history), history, canonical(tokenizer, "Yes"), "Yes")
    record(manager, prompt_ids, [USER], canonical(tokenizer, "7"), "7", sid="other")

    base = Sample(group_index=3, index=7, prompt="What is 12 + 7?", label="19", metadata={"source": "gsm"})
    first, retry = manager.get_trajectory("s", base_sample=base, reward=0.5)
    assert first.metadata["turn_indices"] == [0, 2] and retry.metadata["turn_indices"] == [1]
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(first, 1)] == ["19", "Yes"]
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs(retry, 1)] == ["20"]
    for sample in (first, retry):
        assert (sample.group_index, sample.index, sample.session_id, sample.label) == (3, 7, "s", "19")
        assert sample.metadata["source"] == "gsm" and sample.metadata["num_leaves"] == 2 and sample.reward == 0.5
    assert not manager.has_session("s") and manager.has_session("other")
    manager.drop_session("other")
    assert not manager.has_session("other") and manager.get_trajectory("other", base_sample=base) == []


def test_ill_formed_and_truncated_turns_are_trained_and_flagged(tokenizer):
    manager = TrajectoryManager()
    bad_text = "<tool_call>{not json</tool_call>"
    bad_call = canonical(tokenizer, bad_text)
    record(manager, render(tokenizer, [USER]), [USER], bad_call, bad_text, ill_formed=True)
    history = [USER, {"role": "assistant", "content": bad_text},
               {"role": "tool", "content": "error: tool call is not valid JSON"}]
    cut = tokenizer.encode("The answer is", add_special_tokens=False)  # no end-of-turn: max_new_tokens reached
    record(manager, render(tokenizer, history), history, cut, "The answer is", finish_reason="length")
    [sample] = manager.get_trajectory("s", base_sample=BASE)
    assert sum(sample.loss_mask) == len(bad_call) + len(cut)
    assert "error: tool call is not valid JSON" in tokenizer.decode(runs(sample, 0)[0])
    assert sample.metadata["num_ill_formed_turns"] == 1 and sample.metadata["ill_formed"]
    assert sample.status == Sample.Status.TRUNCATED and sample.metadata["truncated"]


def test_empty_outputs_give_no_sample_and_bad_records_are_refused(tokenizer):
    manager = TrajectoryManager()
    prompt_ids = render(tokenizer, [USER])
    record(manager, prompt_ids, [USER], [], "", finish_reason="abort")
    assert manager.turn_count("s") == 1 and manager.get_trajectory("s", base_sample=BASE) == []
    with pytest.raises(AssertionError, match="output_log_probs"):  # slime's contract: an AssertionError
        manager.record_turn("s", turn=TurnRecord(prompt_ids, [5, 6], "stop", [-0.1]), prompt_messages=[USER],
                            response_message=None)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        manager.record_turn("s", turn=TurnRecord([], [5], "stop", [-0.1]), prompt_messages=[USER],
                            response_message=None)
    with pytest.raises(ValueError, match="fork_threshold_tokens"):
        TrajectoryManager(fork_threshold_tokens=-1)
    with pytest.raises(TypeError):
        manager.get_trajectory("s")  # base_sample is required, as in slime
