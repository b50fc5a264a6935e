"""SFT "rollout": chat conversations from the dataset -> Samples with loss on the assistant turns only.

Use with `--rollout-function-path slime.rollout.sft_rollout.generate_rollout --loss-type sft_loss`. No engine is
involved: the prompt column holds the whole conversation (a list of {role, content} messages, without
`--apply-chat-template`), tokenized with the tokenizer's chat template.

How the assistant tokens are found: the conversation is rendered message by message; each rendering must extend
the previous one (checked: a template that rewrites earlier turns is an error, not a silently wrong mask). Each
new piece is tokenized on its own and appended, so token boundaries never straddle two messages. For an
assistant message the piece is split at the end of the generation prompt (`add_generation_prompt=True`): the
header ("<|im_start|>assistant\\n") gets loss mask 0, the content and the template's end-of-turn get 1.
"""

from __future__ import annotations

from slime.rollout.dataset import tokenizer_for
from slime.utils.types import Sample


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def tokenize_conversation(tokenizer, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """(token ids, per-token mask) of a chat conversation; mask is 1 exactly on assistant-turn tokens."""
    token_ids: list[int] = []
    mask: list[int] = []
    rendered = ""

    def append(text: str, trainable: bool, upto: int) -> None:
        nonlocal rendered
        if not text.startswith(rendered):
            raise ValueError(
                f"the chat template renders message {upto} in a way that changes earlier turns (the rendering of "
                f"messages[:{upto + 1}] does not start with that of messages[:{upto}]); SFT loss masks need a "
                "template whose renderings extend each other"
            )
        ids = _encode(tokenizer, text[len(rendered):])
        token_ids.extend(ids)
        mask.extend([1 if trainable else 0] * len(ids))
        rendered = text

    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            append(_render(tokenizer, messages[:i], tools, add_generation_prompt=True), False, i)
            append(_render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False), True, i)
        else:
            append(_render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False), False, i)
    return token_ids, mask


def build_sft_sample(tokenizer, sample: Sample) -> Sample:
    messages = sample.prompt
    if not isinstance(messages, list):
        raise ValueError(
            f"SFT sample {sample.index}: the prompt must be chat messages (a list of {{role, content}}), got "
            f"{type(messages).__name__}; point --input-key at the messages column and drop --apply-chat-template"
        )
    tools = sample.metadata.get("tools") or None
    token_ids, mask = tokenize_conversation(tokenizer, messages, tools)
    if 1 not in mask:
        raise ValueError(f"SFT sample {sample.index}: the conversation has no assistant message to train on")
    first_trainable = mask.index(1)
    sample.tokens = token_ids
    sample.response_length = len(token_ids) - first_trainable
    sample.loss_mask = mask[first_trainable:]
    sample.response = tokenizer.decode(token_ids[first_trainable:])
    sample.reward = 0.0
    sample.status = Sample.Status.COMPLETED
    return sample


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """`--rollout-batch-size` groups of SFT samples from the data source (no generation, reward 0)."""
    if evaluation:
        raise ValueError("the SFT rollout has no evaluation mode; leave --eval-interval unset for SFT runs")
    tokenizer = tokenizer_for(args)
    if tokenizer is None:
        raise ValueError("the SFT rollout needs --hf-checkpoint: its tokenizer's chat template builds the tokens")
    groups = data_source.get_samples(int(args.rollout_batch_size))
    return [[build_sft_sample(tokenizer, sample) for sample in group] for group in groups]
