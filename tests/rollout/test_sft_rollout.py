import json

import pytest

from slime.rollout.data_source import RolloutDataSource
from slime.rollout.dataset import load_tokenizer
from slime.rollout.sft_rollout import build_sft_sample, generate_rollout, tokenize_conversation
from slime.utils.types import Sample
from tests.helpers import args_helpers

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "The answer is 19"},
    {"role": "user", "content": "And 3 * 4?"},
    {"role": "assistant", "content": "12"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("sft_tok")
    build_tokenizer(out)
    return str(out)


def test_mask_covers_exactly_the_assistant_turns(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    token_ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    assert len(token_ids) == len(mask)
    full_text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(token_ids) == full_text
    trained = [t for t, m in zip(token_ids, mask) if m]
    assert tokenizer.decode(trained) == "The answer is 19<|im_end|>\n12<|im_end|>\n"
    # the masked-out part is everything else, headers included
    untrained_text = tokenizer.decode([t for t, m in zip(token_ids, mask) if not m])
    assert untrained_text == full_text.replace("The answer is 19<|im_end|>\n", "").replace("12<|im_end|>\n", "")
    assert untrained_text.endswith("<|im_start|>assistant\n")
    # each trained span is contiguous and ends with the end-of-turn token the model must learn to emit
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spans = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    assert len(spans) == 3  # 0->1, 1->0, 0->1 (the conversation ends inside the last assistant turn)
    assert token_ids[spans[1] - 2] == im_end


def test_sample_fields_and_response_span(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    sample = build_sft_sample(tokenizer, Sample(prompt=CONVERSATION, index=0))
    token_ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    first = mask.index(1)
    assert sample.tokens == token_ids
    assert sample.response_length == len(token_ids) - first == len(sample.loss_mask)
    assert sample.loss_mask == mask[first:] and sample.loss_mask[0] == 1 and 0 in sample.loss_mask
    assert tokenizer.decode(sample.tokens[: sample.prompt_length]).endswith("<|im_start|>assistant\n")
    assert sample.reward == 0.0 and sample.status == Sample.Status.COMPLETED


def test_errors_name_the_problem(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    with pytest.raises(ValueError, match="no assistant message"):
        build_sft_sample(tokenizer, Sample(prompt=CONVERSATION[:2]))
    with pytest.raises(ValueError, match="must be chat messages"):
        build_sft_sample(tokenizer, Sample(prompt="plain text"))
    rewriting = load_tokenizer(tokenizer_dir).__class__.from_pretrained(tokenizer_dir)
    rewriting.chat_template = (  # hides the content of earlier assistant turns, so renderings are not prefixes
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="changes earlier turns"):
        tokenize_conversation(rewriting, CONVERSATION)


def test_generate_rollout_groups(tmp_path, tokenizer_dir):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATION[i:]}) + "\n" for i in (0, 1, 0)))
    args = args_helpers.make_args("--prompt-data", path, "--input-key", "messages", "--rollout-batch-size", 2,
                                  hf_checkpoint=tokenizer_dir)
    groups = generate_rollout(args, 0, RolloutDataSource(args))
    assert [len(g) for g in groups] == [1, 1]
    assert groups[1][0].tokens != groups[0][0].tokens  # second row lacks the system message
    assert all(s.loss_mask and sum(s.loss_mask) > 0 for g in groups for s in g)
    with pytest.raises(ValueError, match="no evaluation"):
        generate_rollout(args, 0, RolloutDataSource(args), evaluation=True)
