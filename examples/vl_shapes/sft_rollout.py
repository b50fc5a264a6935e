"""SFT warm start of the vl_shapes example: each prompt (rendered with its image by the checkpoint's processor,
`--apply-chat-template --multimodal-keys '{"image": "images"}'`) followed by its label and the end-of-turn token;
loss on the answer only. The pixel values and grids come from the same processor call as the prompt ids (the one
image policy), as in the RL rollout.

    --rollout-function-path examples.vl_shapes.sft_rollout.generate_rollout --loss-type sft_loss --debug-train-only
"""

from __future__ import annotations

from slime.rollout.dataset import tokenizer_for
from slime.rollout.generate_request import encode_multimodal_prompt
from slime.utils.types import Sample

END_OF_TURN = "<|im_end|>"


def build_sample(args, tokenizer, sample: Sample) -> Sample:
    if not sample.multimodal_inputs:
        raise ValueError(f"SFT sample {sample.index}: no image; run with --multimodal-keys '{{\"image\": \"images\"}}'")
    encode_multimodal_prompt(args, sample)
    answer = tokenizer(f"{sample.label}{END_OF_TURN}", add_special_tokens=False)["input_ids"]
    sample.tokens = sample.tokens + answer
    sample.response_length, sample.loss_mask = len(answer), [1] * len(answer)
    sample.response = f"{sample.label}{END_OF_TURN}"
    sample.reward, sample.status = 0.0, Sample.Status.COMPLETED
    return sample


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    if evaluation:
        raise ValueError("the vl_shapes SFT rollout has no evaluation mode; leave --eval-interval unset")
    tokenizer = tokenizer_for(args)
    groups = data_source.get_samples(int(args.rollout_batch_size))
    return [[build_sample(args, tokenizer, sample) for sample in group] for group in groups]
