import json

import pytest

from slime.rollout.data_source import (
    RolloutDataSource,
    RolloutDataSourceWithBuffer,
    create_data_source,
)
from slime.rollout.dataset import load_eval_datasets
from slime.utils.data import parse_path_spec
from slime.utils.eval_config import parse_eval_prompt_data
from slime.utils.types import Sample
from tests.helpers import args_helpers


def make_args(**overrides):
    defaults = {"hf_checkpoint": None, "n_samples_per_prompt": 2, "label_key": "label"}
    return args_helpers.make_args(**{**defaults, **overrides})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def ten_prompts(tmp_path):
    rows = [{"input": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(10)]
    return write_jsonl(tmp_path / "d.jsonl", rows)


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return str(out)


def prompts_of(groups):
    return [g[0].prompt for g in groups]


def test_jsonl_groups_indices_and_fields(ten_prompts):
    source = RolloutDataSource(make_args(prompt_data=ten_prompts))
    assert len(source) == 10
    groups = source.get_samples(3)
    assert prompts_of(groups) == ["q0", "q1", "q2"]
    assert [[s.group_index for s in g] for g in groups] == [[0, 0], [1, 1], [2, 2]]
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3], [4, 5]]
    assert groups[1][0].label == "1" and groups[1][0].metadata == {"i": 1}
    groups[0][0].metadata["i"] = 99  # copies are deep: siblings and the dataset are untouched
    assert groups[0][1].metadata == {"i": 0}
    assert source.get_samples(1)[0][0].index == 6


def test_parquet_and_slicing(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input": [f"p{i}" for i in range(6)], "label": list(range(6))}), path)
    source = RolloutDataSource(make_args(prompt_data=f"{path}@[2:5]", n_samples_per_prompt=1))
    assert len(source) == 3
    assert prompts_of(source.get_samples(3)) == ["p2", "p3", "p4"]
    messages_path = tmp_path / "m.parquet"
    messages = [[{"role": "user", "content": f"m{i}"}] for i in range(2)]
    pq.write_table(pa.table({"input": messages}), messages_path)
    chat = RolloutDataSource(make_args(prompt_data=str(messages_path), n_samples_per_prompt=1,
                                       label_key=None)).get_samples(2)
    assert [g[0].prompt for g in chat] == messages
    assert parse_path_spec("a.jsonl@[:-2]") == ("a.jsonl", None, -2)
    assert parse_path_spec("a.jsonl") == ("a.jsonl", None, None)


def test_chat_messages_tools_and_template(tmp_path, tiny_tokenizer_dir):
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"input": messages, "tools": [{"name": "calc"}], "label": "x"}])
    raw = RolloutDataSource(make_args(prompt_data=path, n_samples_per_prompt=1)).get_samples(1)[0][0]
    assert raw.prompt == messages and raw.metadata["tools"] == [{"name": "calc"}]
    templated = RolloutDataSource(
        make_args(prompt_data=path, n_samples_per_prompt=1, apply_chat_template=True, hf_checkpoint=tiny_tokenizer_dir)
    ).get_samples(1)[0][0]
    # the row's tools reach the chat template (the tiny template renders them in a system block, as Qwen's does)
    assert templated.prompt.startswith('<|im_start|>system\n# Tools\n{"name": "calc"}\n')
    assert templated.prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_text_prompt_that_looks_like_json_stays_text_and_metadata_string_is_decoded(tmp_path):
    rows = [{"input": "[1, 2] + [3]?", "metadata": '{"rm_type": "math"}'}]
    source = RolloutDataSource(make_args(prompt_data=write_jsonl(tmp_path / "j.jsonl", rows), label_key=None))
    sample = source.get_samples(1)[0][0]
    assert sample.prompt == "[1, 2] + [3]?" and sample.metadata == {"rm_type": "math"}


def test_number_prompt_is_kept_for_a_generate_hook_as_slime_keeps_it(tmp_path, tiny_tokenizer_dir):
    """slime's tau-bench rows are {"index": 3, ...} with --input-key index: the task index its generate hook reads."""
    from slime.rollout.dataset import load_tokenizer, prompt_token_ids

    path = write_jsonl(tmp_path / "n.jsonl", [{"index": 3, "metadata": {"split": "train"}}])
    sample = RolloutDataSource(make_args(prompt_data=path, input_key="index", label_key=None)).get_samples(1)[0][0]
    assert sample.prompt == 3 and sample.metadata == {"split": "train"}
    assert Sample.from_dict(sample.to_dict()).prompt == 3
    with pytest.raises(ValueError, match="prompt is the number 3.*--custom-generate-function-path"):
        prompt_token_ids(load_tokenizer(tiny_tokenizer_dir), sample)  # the default generate function's tokens
    with pytest.raises(ValueError, match=rf"{path}:1: 'index' is the number 3; --apply-chat-template needs text"):
        RolloutDataSource(make_args(prompt_data=path, input_key="index", label_key=None, apply_chat_template=True,
                                    hf_checkpoint=tiny_tokenizer_dir))
    bad = write_jsonl(tmp_path / "b.jsonl", [{"input": {"q": 1}}, {"input": True}])
    with pytest.raises(ValueError, match=rf"{bad}:1: 'input' must be a string, chat messages or a number"):
        RolloutDataSource(make_args(prompt_data=bad, label_key=None))


def test_sample_status_given_as_its_string_becomes_the_status():
    """slime's tau-bench example builds Sample(status="completed"); the status must compare as the member."""
    assert Sample(status="truncated").status is Sample.Status.TRUNCATED
    with pytest.raises(ValueError, match="Sample status 'done': use one of .*'completed'"):
        Sample(status="done")


def test_long_prompts_filtered(tmp_path, tiny_tokenizer_dir):
    from slime.rollout.dataset import load_tokenizer

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    texts = ["1", "1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9", "2"]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert lengths[1] > 5 >= max(lengths[0], lengths[2])
    path = write_jsonl(tmp_path / "l.jsonl", [{"input": t} for t in texts])
    source = RolloutDataSource(
        make_args(prompt_data=path, rollout_max_prompt_len=5, hf_checkpoint=tiny_tokenizer_dir, n_samples_per_prompt=1,
                  label_key=None)
    )
    assert len(source) == 2 and source.num_filtered_long_prompts == 1
    assert prompts_of(source.get_samples(2)) == ["1", "2"]


def test_malformed_row_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "a"}\n\n{"input": "b",\n')
    with pytest.raises(ValueError, match=rf"{path}:3: malformed JSON"):
        RolloutDataSource(make_args(prompt_data=str(path)))


def test_missing_input_key_names_key_line_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"input": "a"}, {"question": "b", "answer": "c"}])
    with pytest.raises(ValueError) as err:
        RolloutDataSource(make_args(prompt_data=path, label_key=None))
    message = str(err.value)
    assert f"{path}:2" in message and "'input'" in message and "['answer', 'question']" in message


def test_empty_dataset_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="has no prompts"):
        RolloutDataSource(make_args(prompt_data=str(path)))
    with pytest.raises(ValueError, match="does not exist"):
        RolloutDataSource(make_args(prompt_data=str(tmp_path / "missing.jsonl")))


def test_epochs_wrap_and_seeded_shuffle(ten_prompts):
    args = make_args(prompt_data=ten_prompts, n_samples_per_prompt=1, rollout_shuffle=True, rollout_seed=7)
    source = RolloutDataSource(args)
    epoch0 = prompts_of(source.get_samples(10))
    epoch1 = prompts_of(source.get_samples(10))
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"q{i}" for i in range(10))
    assert epoch0 != epoch1 and source.epoch_id == 1
    # the order is a function of the seed and epoch only
    again = RolloutDataSource(args)
    assert prompts_of(again.get_samples(20)) == epoch0 + epoch1
    other_seed = RolloutDataSource(make_args(prompt_data=ten_prompts, n_samples_per_prompt=1, rollout_shuffle=True))
    assert prompts_of(other_seed.get_samples(10)) != epoch0
    unshuffled = RolloutDataSource(make_args(prompt_data=ten_prompts, n_samples_per_prompt=1))
    assert prompts_of(unshuffled.get_samples(13)) == [f"q{i}" for i in range(10)] + ["q0", "q1", "q2"]


def test_state_save_load_resumes_same_order(ten_prompts, tmp_path):
    args = make_args(prompt_data=ten_prompts, rollout_shuffle=True, save=str(tmp_path / "ckpt"))
    reference = RolloutDataSourceWithBuffer(args)
    expected = [[(s.prompt, s.index, s.group_index) for s in g] for g in reference.get_samples(17)]

    first = RolloutDataSourceWithBuffer(args)
    head = first.get_samples(7)  # crosses nothing yet; the next call crosses the epoch boundary
    extra = Sample(prompt="buffered", index=1000, group_index=500, status=Sample.Status.ABORTED, response_length=2)
    first.add_samples([[extra, Sample(prompt="buffered", index=1001, group_index=500)]])
    path = first.save(3)
    assert path == tmp_path / "ckpt" / "rollout" / "data_source_state_3.json"

    resumed = RolloutDataSourceWithBuffer(args)
    assert resumed.load(3)
    buffered = resumed.get_samples(1)[0]
    assert [(s.prompt, s.index, s.status) for s in buffered] == [
        ("buffered", 1000, Sample.Status.ABORTED),
        ("buffered", 1001, Sample.Status.PENDING),
    ]
    tail = resumed.get_samples(10)
    got = [[(s.prompt, s.index, s.group_index) for s in g] for g in head + tail]
    assert got == expected
    assert not RolloutDataSourceWithBuffer(args).load(99)  # no state yet: fresh start, not an error


def test_buffer_first_then_dataset_and_group_size_checked(ten_prompts):
    source = create_data_source(make_args(prompt_data=ten_prompts))
    assert isinstance(source, RolloutDataSourceWithBuffer)
    old = source.get_samples(2)
    source.add_samples([old[1]])
    groups = source.get_samples(2)
    assert prompts_of(groups) == ["q1", "q2"] and groups[0][0].index == 2
    with pytest.raises(ValueError, match="n-samples-per-prompt is 2"):
        source.add_samples([[Sample()]])


def test_data_source_path_override(ten_prompts):
    path = "slime.rollout.data_source.RolloutDataSource"
    source = create_data_source(make_args(prompt_data=ten_prompts, data_source_path=path))
    assert type(source) is RolloutDataSource
    with pytest.raises(ValueError, match="--data-source-path"):
        create_data_source(make_args(data_source_path="slime.rollout.data_source.Nope"))


def test_no_global_dataset_gives_empty_samples():
    source = RolloutDataSource(make_args())
    groups = source.get_samples(2)
    assert len(source) == 0 and [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    assert groups[0][0].prompt == ""


def test_eval_datasets(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"problem": "x", "answer": "1"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"problem": "y", "answer": "2"}, {"problem": "z", "answer": "3"}])
    args = args_helpers.make_args("--eval-prompt-data", "first", a, "second", b, "--eval-input-key", "problem",
                                  "--eval-label-key", "answer", hf_checkpoint=None)
    datasets = load_eval_datasets(args)
    assert [(d.name, len(d.samples)) for d in datasets] == [("first", 1), ("second", 2)]
    assert datasets[1].samples[1].prompt == "z" and datasets[1].samples[1].label == "3"
    assert parse_eval_prompt_data([a]) == [("eval", a)]
    with pytest.raises(ValueError, match="pairs"):
        parse_eval_prompt_data(["x", a, "y"])
