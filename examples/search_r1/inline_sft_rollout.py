"""SFT rows for inline tool answers: the prompt, then the assistant's text in segments, each trainable or not.

    --rollout-function-path examples.search_r1.inline_sft_rollout.generate_rollout --loss-type sft_loss

Why not `slime.rollout.sft_rollout`: it masks whole chat messages, so an assistant turn that carries the tool's
answer inline (`<search>q</search>\\n\\n<information>...</information>\\n\\n<answer>a</answer>`, one message)
would be trained on the retrieved text too. Here a row's `metadata.segments` is `[[text, trainable], ...]` and
the tokens are laid out as `slime.rollout.multi_turn` lays out a rollout of the same conversation: the prompt
rendered with the row's `tools` column if it has one (the GRPO run with the xml_tags parser offers no tool block:
the question itself names the tags), then each segment tokenized on its own, loss mask 1 on the model's segments and 0 on the `<information>` text.
"""

from __future__ import annotations

from slime.rollout.dataset import render_chat_prompt, tokenizer_for
from slime.utils.types import Sample


def build_segmented_sample(tokenizer, sample: Sample) -> Sample:
    segments = sample.metadata.get("segments")
    if not isinstance(segments, list) or not all(isinstance(s, list) and len(s) == 2 for s in segments):
        raise ValueError(f"SFT sample {sample.index}: metadata.segments must be [[text, trainable], ...]")
    if not any(trainable for _, trainable in segments):
        raise ValueError(f"SFT sample {sample.index}: no trainable segment")
    prompt_text = render_chat_prompt(tokenizer, sample.prompt, tools=sample.metadata.get("tools") or None)
    tokens = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    mask = []
    for text, trainable in segments:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens += ids
        mask += [1 if trainable else 0] * len(ids)
    sample.tokens, sample.loss_mask, sample.response_length = tokens, mask, len(mask)
    sample.response = "".join(text for text, _ in segments)
    sample.reward, sample.status = 0.0, Sample.Status.COMPLETED
    return sample


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    if evaluation:
        raise ValueError("the inline SFT rollout has no evaluation mode; leave --eval-interval unset")
    tokenizer = tokenizer_for(args)
    if tokenizer is None:
        raise ValueError("the inline SFT rollout needs --hf-checkpoint (its chat template renders the prompt)")
    groups = data_source.get_samples(int(args.rollout_batch_size))
    return [[build_segmented_sample(tokenizer, sample) for sample in group] for group in groups]
