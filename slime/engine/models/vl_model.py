"""Qwen2.5-VL and Qwen3-VL in the engine: the checkpoint's vision tower, the engine's own decoder as the language
model, M-RoPE positions, and Qwen3-VL's deepstack (vision features added to the hidden states after the first
layers, at the image tokens).

Module names follow the HF checkpoint (`model.visual.*`, `model.language_model.*`, `lm_head`), so every weight
route (checkpoint, pushed tensors, broadcast, disk) loads the vision tower and the language model through the one
name mapping of weight_loader.py. The vision tower is transformers' module for the checkpoint's vision_config (its
attention through torch SDPA), run once per step over every image that step needs, batched. The language model is
DecoderModel (the engine's kernels, paged KV cache, decode CUDA graphs).

A step's image tokens carry ids >= vocab_size (image_prompt.py's content ids): their rows take the image embeddings
the runner passes, in flat-batch order. 3-D positions [3, num_tokens] (a prefill with images) rotate through a
per-step cos/sin table; 1-D positions (decode, text) are the text model's, shifted by the runner.
Served at tp_size 1 only (refused by name otherwise).
"""

from __future__ import annotations

import torch
from torch import nn

from slime.engine.layers.attention import AttentionMetadata
from slime.engine.models.decoder import DecoderForCausalLM, DecoderModel
from slime.engine.models.model_config import ModelConfig
from slime.engine.models.mrope import mrope_axis_of_frequency, mrope_cos_sin
from slime.engine.parallel.state import SINGLE, ParallelState
from slime.engine.parallel.vocab import ParallelLMHead


def build_vision_tower(model_type: str, vision_config: dict) -> nn.Module:
    """transformers' vision model of a Qwen2.5-VL / Qwen3-VL vision_config (random init; weights load later)."""
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        config = Qwen2_5_VLVisionConfig(**vision_config)
        config._attn_implementation = "sdpa"
        return Qwen2_5_VisionTransformerPretrainedModel(config)
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(**vision_config)
    config._attn_implementation = "sdpa"
    return Qwen3VLVisionModel(config)


class VisionLanguageModel(nn.Module):
    """`model.visual` and `model.language_model`, as the checkpoint names them."""

    def __init__(self, config: ModelConfig, parallel: ParallelState):
        super().__init__()
        self.language_model = DecoderModel(config, parallel)
        self.visual = build_vision_tower(config.model_type, config.vision_config)

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers


class VLForConditionalGeneration(DecoderForCausalLM):
    embedding_weight_name = "model.language_model.embed_tokens.weight"

    def __init__(self, config: ModelConfig, parallel: ParallelState = SINGLE):
        nn.Module.__init__(self)
        if parallel.tp_size > 1 or parallel.ep_size > 1:
            raise ValueError(f"{config.model_type} (vision-language) is served at --tp-size 1 only (engine "
                             "Config.tp_size); run more engines instead of sharding one")
        self.config = config
        self.parallel = parallel
        self.model = VisionLanguageModel(config, parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        axis = torch.as_tensor(mrope_axis_of_frequency(config.mrope_section, config.mrope_interleaved))
        self.register_buffer("axis_of_frequency", axis, persistent=False)
        self.merge_size = int(config.vision_config.get("spatial_merge_size", 2))

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
        """(image embeddings [num_image_tokens, hidden], deepstack features: a list of the same shape per deepstack
        layer, empty for Qwen2.5-VL) of every image of a batch, in order."""
        visual = self.model.visual
        output = visual(pixel_values.to(visual.dtype), grid_thw=image_grid_thw, return_dict=True)
        deepstack = list(getattr(output, "deepstack_features", None) or [])
        return output.pooler_output, deepstack

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                image_embeds: torch.Tensor | None = None, deepstack: list | None = None) -> torch.Tensor:
        language_model = self.model.language_model
        vocab_size = self.config.vocab_size
        image_rows = input_ids >= vocab_size
        hidden = language_model.embed_tokens(torch.where(image_rows, 0, input_ids))
        if image_embeds is not None:
            hidden = hidden.index_put((image_rows,), image_embeds.to(hidden.dtype))
        if positions.dim() == 1:
            return self._decoder(hidden, positions, meta, image_rows, deepstack)
        rotary = language_model.rotary
        tables = rotary.cos, rotary.sin
        rotary.cos, rotary.sin = mrope_cos_sin(rotary.cos, rotary.sin, positions, self.axis_of_frequency)
        try:  # row i of the step's table is token i's rotation
            return self._decoder(hidden, torch.arange(positions.shape[1], device=positions.device), meta,
                                 image_rows, deepstack)
        finally:
            rotary.cos, rotary.sin = tables

    def _decoder(self, hidden, positions, meta, image_rows, deepstack):
        language_model = self.model.language_model
        residual = None
        for index, layer in enumerate(language_model.layers):
            hidden, residual = layer(positions, hidden, residual, meta)
            if deepstack and index < len(deepstack):  # adds to the hidden state (the next add folds in residual)
                hidden = hidden.index_put((image_rows,), deepstack[index].to(hidden.dtype), accumulate=True)
        return language_model.final_norm(hidden, residual)
