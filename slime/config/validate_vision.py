"""Start-up rules of vision-language training: `--multimodal-keys` and a vision-language `--hf-checkpoint`.

`--multimodal-keys` (slime's: a JSON map from modality to the data column holding that modality's items) takes
`image` only; it needs `--apply-chat-template` (the checkpoint's chat template writes each image's placeholder) and a
Qwen2.5-VL / Qwen3-VL checkpoint. A vision-language checkpoint trains with the FSDP backend only (Megatron refuses it
by model type), without a critic. Each rule raises `ArgumentError` naming the flag and how to fix it.

Not here: reading images (slime.rollout.multimodal_data) or the image-size policy (slime.utils.image_policy).
"""

from __future__ import annotations

import json
from pathlib import Path

from slime.config.errors import require
from slime.utils.image_policy import VL_MODEL_TYPES

SUPPORTED_MODALITIES = ("image",)


def checkpoint_vision_model_type(path) -> str | None:
    """The model_type of a checkpoint with a vision tower (its config.json has `vision_config`), else None."""
    config_file = Path(path) / "config.json" if path is not None else None
    if config_file is None or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config.get("model_type") if config.get("vision_config") is not None else None


def check_vision_language_flags(args) -> None:
    keys = args.multimodal_keys
    model_type = checkpoint_vision_model_type(args.hf_checkpoint)
    if keys:
        unsupported = sorted(set(keys) - set(SUPPORTED_MODALITIES))
        require(not unsupported, f"--multimodal-keys: modality {', '.join(map(repr, unsupported))} is not supported "
                                 f"(only {SUPPORTED_MODALITIES}); drop it from the JSON map")
        require(all(isinstance(column, str) and column for column in keys.values()),
                f"--multimodal-keys {json.dumps(keys)}: each value must be the name of a data column, e.g. "
                "'{\"image\": \"images\"}'")
        require(args.apply_chat_template, "--multimodal-keys needs --apply-chat-template: the checkpoint's chat "
                                          "template writes each image's placeholder into the prompt")
        require(model_type is not None, f"--multimodal-keys needs a vision-language --hf-checkpoint; "
                                        f"{args.hf_checkpoint} has no vision_config in its config.json")
    if model_type is None:
        return
    require(model_type in VL_MODEL_TYPES,
            f"--hf-checkpoint {args.hf_checkpoint}: vision-language model type {model_type!r} is not supported; "
            f"supported: {', '.join(VL_MODEL_TYPES)}")
    require(args.train_backend != "megatron",
            f"--train-backend megatron: vision-language models ({model_type}) are not supported by the Megatron "
            "backend here; use --train-backend fsdp")
    require(not args.use_critic, f"--advantage-estimator {args.advantage_estimator}: the PPO critic does not take "
                                 f"images; train the vision-language model ({model_type}) with a critic-free "
                                 "estimator (grpo, gspo, reinforce_plus_plus, rloo)")
