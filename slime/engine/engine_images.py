"""The engine's side of vision-language requests: the checkpoint's image policy at start-up (with the refusals of
what a VL model cannot be served with), and a request's images turned into the ids the engine schedules and their
ImagePrompt (image_prompt.py). A mixin of Engine; not the model (models/vl_model.py) nor the step inputs
(vl_step.py).
"""

from __future__ import annotations

from slime.engine.image_prompt import build_image_prompt
from slime.utils.image_policy import load_vl_processor


class EngineImages:
    def _vl_processor(self):
        """The image policy of a vision-language checkpoint (None for a text model); refuses what VL cannot use."""
        if not self.model_config.is_vision_language:
            return None
        if self.config.tp_size > 1:
            raise ValueError(f"--tp-size {self.config.tp_size} (engine Config.tp_size): the vision-language "
                             f"{self.model_config.model_type} is served at --tp-size 1 only; run more engines "
                             "(--rollout-num-gpus-per-engine 1) instead of sharding one")
        if self.config.enable_lora:
            raise ValueError(f"enable_lora (--enable-lora): LoRA adapters are not served for the vision-language "
                             f"{self.model_config.model_type}; serve the merged model")
        return load_vl_processor(self.config.model)

    def _image_prompt(self, prompt_token_ids: list[int], images):
        """(the ids the engine schedules, ImagePrompt) of a prompt with images (image_prompt.py)."""
        if self.vl_processor is None:
            raise ValueError(f"image_data was given but {self.model_config.model_type} is not a vision-language "
                             "model; serve a Qwen2.5-VL or Qwen3-VL checkpoint, or send no images")
        policy = self.vl_processor
        encoded = policy.expand_input_ids(list(prompt_token_ids), images)
        if len(encoded.input_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(encoded.input_ids)} tokens with its images expanded; "
                             f"max_model_len is {self.max_model_len}, which must leave room for an output token")
        return build_image_prompt(encoded, images, policy.merge_size, policy.image_token_id,
                                  self.model_config.vocab_size)
