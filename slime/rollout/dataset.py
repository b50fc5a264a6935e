"""Prompt datasets: `.jsonl` / `.parquet` rows -> one prompt `Sample` per row.

Handles `path@[start:end]` row slicing, the `--input-key` / `--label-key` / `--metadata-key` / `--tool-key` columns,
`--apply-chat-template`, images (`--multimodal-keys`, multimodal_data.py: rendered with the vision-language
checkpoint's processor), and the `--rollout-max-prompt-len` filter (image tokens count). Errors in user data name the file and line;
a row without the `--label-key` column is one, unless `--allow-missing-labels` or the reward reads no labels.
Not here: epochs, shuffling and the buffer (data_source.py), or any tokenization of responses.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from slime.rollout.multimodal_data import messages_with_images, messages_without_pixels, row_images
from slime.rollout.rm_hub import reward_uses_labels
from slime.utils.data import parse_path_spec, read_rows
from slime.utils.eval_config import EvalDatasetConfig
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """The Hugging Face tokenizer of `--hf-checkpoint` (cached: loading it is the slow part of building a source)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


@functools.lru_cache(maxsize=8)
def load_processor(path: str):
    """The image policy (processor) of a vision-language `--hf-checkpoint` (cached, as the tokenizer)."""
    from slime.utils.image_policy import load_vl_processor

    return load_vl_processor(path)


def _maybe_json(value: Any, location: str, key: str) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{location}: column {key!r} holds malformed JSON ({exc.msg})") from None
    return value


def _validate_messages(messages: list, location: str, key: str) -> None:
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{location}: {key!r} must be a string or a list of {{'role', 'content'}} messages, got {message!r}"
            )


@dataclass
class PromptFormat:
    """How rows become prompts: the column names and chat-template options (from args or an eval dataset)."""

    input_key: str = "input"
    label_key: str | None = None
    label_required: bool = True  # a row without label_key is an error (not when the reward reads no labels)
    metadata_key: str | None = "metadata"
    tool_key: str | None = "tools"
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict | None = None
    max_prompt_len: int | None = None
    multimodal_keys: dict[str, str] | None = None  # modality -> column (--multimodal-keys)

    @classmethod
    def from_args(cls, args, prefix: str = "") -> "PromptFormat":
        """Read `{prefix}input_key` etc. from args, falling back to the un-prefixed flag (eval_ -> rollout)."""

        def pick(name: str, default=None):
            value = getattr(args, f"{prefix}{name}", None) if prefix else None
            return value if value is not None else getattr(args, name, default)

        max_prompt_len = getattr(args, f"{prefix}max_prompt_len", None) if prefix else None
        if max_prompt_len is None:
            max_prompt_len = args.rollout_max_prompt_len
        kwargs = args.apply_chat_template_kwargs
        if isinstance(kwargs, str):
            kwargs = json.loads(kwargs)
        return cls(
            input_key=pick("input_key", "input"),
            label_key=pick("label_key"),
            label_required=not args.allow_missing_labels and reward_uses_labels(args),
            metadata_key=pick("metadata_key", "metadata"),
            tool_key=pick("tool_key", "tools"),
            apply_chat_template=args.apply_chat_template,
            apply_chat_template_kwargs=kwargs or {},
            max_prompt_len=max_prompt_len,
            multimodal_keys=args.multimodal_keys,
        )


def render_chat_prompt(tokenizer, messages: list[dict], tools=None, **template_kwargs) -> str:
    """The chat-templated prompt text, ending with the assistant generation prompt."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
    )


def row_to_sample(row: dict, location: str, fmt: PromptFormat, tokenizer, processor=None) -> Sample:
    if fmt.input_key not in row:
        raise ValueError(
            f"{location}: input key {fmt.input_key!r} (--input-key) not found; the row has keys {sorted(row)}"
        )
    prompt = row[fmt.input_key]  # never JSON-decoded: a text prompt may well start with "[" or "{"
    if isinstance(prompt, list):
        _validate_messages(prompt, location, fmt.input_key)
    elif _is_number(prompt):  # kept as is, as slime does: tau-bench's rows hold a task index for its generate hook
        if fmt.apply_chat_template:
            raise ValueError(f"{location}: {fmt.input_key!r} is the number {prompt!r}; --apply-chat-template needs "
                             "text or chat messages")
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{location}: {fmt.input_key!r} must be a string, chat messages or a number (for a "
            f"--custom-generate-function-path to read), got {type(prompt).__name__}"
        )

    metadata = _maybe_json(row.get(fmt.metadata_key), location, fmt.metadata_key) if fmt.metadata_key else None
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{location}: metadata column {fmt.metadata_key!r} must be an object, got {metadata!r}")
    tools = _maybe_json(row.get(fmt.tool_key), location, fmt.tool_key) if fmt.tool_key else None
    if tools:
        metadata["tools"] = tools

    multimodal_inputs = None
    if fmt.multimodal_keys:
        if processor is None:
            raise ValueError("--multimodal-keys needs a vision-language --hf-checkpoint (its processor renders the "
                             "images)")
        images = row_images(row, location, fmt.multimodal_keys)
        messages = messages_without_pixels(messages_with_images(prompt, images, location))
        prompt = processor.apply_chat_template(messages, tools=tools or None,
                                               **(fmt.apply_chat_template_kwargs or {}))
        metadata.setdefault("messages", messages)
        multimodal_inputs = {"images": images} if images else None
    elif fmt.apply_chat_template:
        if tokenizer is None:
            raise ValueError("--apply-chat-template needs --hf-checkpoint (the tokenizer that holds the template)")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        prompt = render_chat_prompt(tokenizer, messages, tools=tools or None, **(fmt.apply_chat_template_kwargs or {}))
        metadata.setdefault("messages", messages)  # a multi-turn rollout re-renders them with its tools and turns

    if fmt.label_key and fmt.label_required and fmt.label_key not in row:
        raise ValueError(
            f"{location}: label key {fmt.label_key!r} (--label-key / --eval-label-key) not found; the row has keys "
            f"{sorted(row)}. Add the label, or pass --allow-missing-labels if these rows have none"
        )
    label = row.get(fmt.label_key) if fmt.label_key else None
    return Sample(prompt=prompt, label=label, metadata=metadata, multimodal_inputs=multimodal_inputs)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def prompt_token_ids(tokenizer, sample: Sample) -> list[int]:
    """Token ids of a sample's prompt: chat messages go through the chat template, text is tokenized as is."""
    if _is_number(sample.prompt):
        raise ValueError(f"sample {sample.index}: the prompt is the number {sample.prompt!r}, which has no tokens; "
                         "a --custom-generate-function-path that reads it (as slime's tau-bench example reads a task "
                         "index) must make the tokens")
    if isinstance(sample.prompt, list):
        tools = sample.metadata.get("tools") if isinstance(sample.metadata, dict) else None
        text = render_chat_prompt(tokenizer, sample.prompt, tools=tools or None)
    else:
        text = sample.prompt
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_length(tokenizer, processor, sample: Sample) -> int:
    """Number of prompt tokens, each image counted as the image tokens it expands to."""
    if sample.multimodal_inputs:
        return len(processor.encode(sample.prompt, sample.multimodal_inputs["images"]).input_ids)
    return len(prompt_token_ids(tokenizer, sample))


def load_prompt_samples(spec: str, fmt: PromptFormat, tokenizer=None) -> tuple[list[Sample], int]:
    """Load `path[@[start:end]]` as prompt Samples; returns (samples, number of prompts filtered as too long)."""
    path, start, end = parse_path_spec(spec)
    rows = list(read_rows(path))[start:end]
    processor = None
    if fmt.multimodal_keys and tokenizer is not None:
        processor = load_processor(str(tokenizer.name_or_path))
    samples = [row_to_sample(row, location, fmt, tokenizer, processor) for location, row in rows]
    num_filtered = 0
    if fmt.max_prompt_len is not None:
        if tokenizer is None:
            raise ValueError("--rollout-max-prompt-len needs --hf-checkpoint (its tokenizer counts prompt tokens)")
        kept = [s for s in samples if prompt_length(tokenizer, processor, s) <= fmt.max_prompt_len]
        num_filtered = len(samples) - len(kept)
        if num_filtered:
            logger.info(
                "%s: filtered %d of %d prompts longer than %d tokens (--rollout-max-prompt-len)",
                spec, num_filtered, len(samples), fmt.max_prompt_len,
            )
        samples = kept
    if not samples:
        reason = ""
        if num_filtered:
            reason = f" (all {num_filtered} are longer than --rollout-max-prompt-len {fmt.max_prompt_len})"
        raise ValueError(f"prompt data {spec!r} has no prompts{reason}")
    return samples, num_filtered


def tokenizer_for(args):
    """The tokenizer of args.hf_checkpoint, or None when no checkpoint is given."""
    path = args.hf_checkpoint
    return load_tokenizer(str(path)) if path else None


@dataclass
class EvalDataset:
    name: str
    path: str
    samples: list[Sample]
    config: EvalDatasetConfig


def load_eval_datasets(args) -> list[EvalDataset]:
    """The eval datasets (`args.eval_datasets`, resolved from --eval-config / --eval-prompt-data), each read with
    its own keys; each sample carries its dataset's rm_type / metadata overrides, reward and generate function."""
    configs = args.eval_datasets
    base = PromptFormat.from_args(args, prefix="eval_")
    tokenizer = tokenizer_for(args)
    datasets = []
    for config in configs:
        fmt = dataclasses.replace(base, input_key=config.input_key or "input", label_key=config.label_key,
                                  metadata_key=config.metadata_key, tool_key=config.tool_key,
                                  apply_chat_template=bool(config.apply_chat_template),
                                  apply_chat_template_kwargs=config.apply_chat_template_kwargs or {},
                                  multimodal_keys=config.multimodal_keys)
        samples, _ = load_prompt_samples(config.path, fmt, tokenizer)
        for sample in samples:
            sample.metadata = config.inject_metadata(sample.metadata)
            sample.custom_rm_path = config.custom_rm_path
            sample.generate_function_path = config.custom_generate_function_path
        datasets.append(EvalDataset(name=config.name, path=config.path, samples=samples, config=config))
    return datasets
