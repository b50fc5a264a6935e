"""Build tiny Hugging Face checkpoints offline: a byte-level BPE tokenizer with a chat template and a small
random-init Qwen2 / Qwen3 / Llama / GLM-4, mixture-of-experts Qwen3-MoE / Qwen2-MoE / GLM-4.5, or DeepSeek-V3-family
(tiny_mla_model.py) model, saved as safetensors.

Used by the quickstart and by tests; nothing here downloads anything. Not a model zoo: sizes are for CPU runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from slime.utils.tiny_mla_model import TINY_MLA_ARCHES, tiny_mla_config, tiny_mla_fields

# Qwen's layout: tools offered in a system block, an assistant's tool calls as <tool_call>{json}</tool_call>, tool
# results as messages of role "tool". A conversation without tools renders exactly as before.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEFAULT_CORPUS = [
    "What is 12 + 7? Answer: \\boxed{19}",
    "Compute 3 * 4 - 5. The answer is \\boxed{7}",
    "The quick brown fox jumps over the lazy dog.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } \\boxed",
    "user assistant system: Please reason step by step, and put your final answer within \\boxed{}.",
]


def build_tokenizer(out_dir: str | Path, corpus: list[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on `corpus` and save it as a PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = list(corpus or DEFAULT_CORPUS)
    tokenizer = Tokenizer(models.BPE())
    # Digits stay single tokens, so arithmetic answers are spelled digit by digit.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


TINY_MOE_SHAPES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                      shared_expert_intermediate_size=64),
    # 3 layers, the first dense; one ungated shared expert; random correction biases (build_tiny_model)
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5,
                     attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0),
}
CORRECTION_BIAS_STD = 0.1  # the tiny GLM-4.5's e_score_correction_bias: large enough to change some choices


def tiny_config(arch: str = "qwen3", vocab_size: int = 512, **overrides):
    """A small transformers config of the given architecture (qwen2, qwen3, llama, glm4, qwen3_moe, qwen2_moe,
    glm4_moe). The MoE ones have 8 experts, 2 per token, experts of intermediate size 32 (Qwen2-MoE: plus a shared
    expert of 64; GLM-4.5: 3 layers, the first dense, one shared expert of 32)."""
    from transformers import (
        Glm4Config,
        Glm4MoeConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch in TINY_MOE_SHAPES:
        common.update(TINY_MOE_SHAPES[arch])
    if arch in TINY_MLA_ARCHES:
        common.update(tiny_mla_fields(arch))
    common.update(overrides)
    if arch in TINY_MLA_ARCHES:
        return tiny_mla_config(arch, common)
    if arch == "qwen3_moe":
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return Qwen3MoeConfig(**common)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return Qwen3Config(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return LlamaConfig(**common)
    if arch in ("glm4", "glm4_moe"):
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return (Glm4Config if arch == "glm4" else Glm4MoeConfig)(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose qwen2, qwen3, llama, glm4, qwen3_moe, qwen2_moe, "
                     f"glm4_moe or one of {sorted(TINY_MLA_ARCHES)}")


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    corpus: list[str] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    max_shard_size: str | None = None,
    embedding_size: int | None = None,
    **config_overrides,
) -> Path:
    """Write a tokenizer plus a random-init model of `arch` to `out_dir` (safetensors) and return the path.
    `embedding_size` (default: the tokenizer's size) pads the vocabulary rows, as real checkpoints do (Qwen3's
    151,936 rows for a smaller tokenizer); ids past the tokenizer decode to nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir, corpus, vocab_size=vocab_size)
    config = tiny_config(
        arch,
        vocab_size=max(embedding_size or 0, len(tokenizer)),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: the bias would not be exercised
                buffer.normal_(std=CORRECTION_BIAS_STD)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    generation_config = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))
    return out_dir
