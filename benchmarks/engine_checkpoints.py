"""The engine benchmark's models, built offline: the model shapes (Qwen3-0.6B, Qwen3-8B, SmolLM-135M, a
Qwen3-30B-A3B-layer MoE with 8 of its 48 layers and 64 of its 128 experts, and tiny CPU variants), random-weight
checkpoints written straight from device tensors as sharded safetensors with a word-level tokenizer that covers the
whole vocabulary, and random prompts. Used by bench_engine.py and profile_engine.py; nothing here
measures anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

QWEN3_06B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
QWEN3_8B_SHAPE = dict(
    QWEN3_06B_SHAPE,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    tie_word_embeddings=False,
)
# SmolLM-135M's shape (a Llama: 30 layers, hidden 576, GQA 9/3, 49,152 embedding rows, tied): 134.5M parameters,
# the under-0.2B model of the engine-speed issue's small-model workload.
SMOLLM_135M_SHAPE = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY_SHAPE = dict(
    QWEN3_06B_SHAPE,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 x 128 query heads, 4 KV heads, experts of 768, top-8 of softmax
# routing, normalized) with 8 layers and 64 experts: 3.2B parameters (0.9B active per token), so training fits one
# H200 next to a colocated engine.
QWEN3_30B_A3B_8L_SHAPE = dict(
    QWEN3_06B_SHAPE,
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
SHAPES = {"qwen3-0.6b": QWEN3_06B_SHAPE, "qwen3-8b": QWEN3_8B_SHAPE, "qwen3-30b-a3b-8l": QWEN3_30B_A3B_8L_SHAPE}
TINY_LARGE_SHAPE = dict(TINY_SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32,
                        tie_word_embeddings=False)

def build_checkpoint(
    out_dir: Path, shape: dict, dtype: torch.dtype, device: str, seed: int, max_shard_bytes: int = 4 << 30
) -> Path:
    """config.json, a word-level tokenizer and random weights as safetensors shards (written straight from
    `device` tensors of `dtype`; norms are ones, everything else N(0, 0.02))."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    CONFIG_CLASSES = {"qwen3": (Qwen3Config, "Qwen3ForCausalLM"), "llama": (LlamaConfig, "LlamaForCausalLM"),
                      "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM")}

    from slime.engine.models import DecoderForCausalLM, load_model_config
    from slime.engine.models.weight_loader import named_weight_shapes

    tokenizer = build_word_level_tokenizer(out_dir, shape["vocab_size"])
    shape = dict(shape)
    config_class, architecture = CONFIG_CLASSES[shape.pop("model_type", "qwen3")]
    config = config_class(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=None, architectures=[architecture], dtype=str(dtype).split(".")[-1])
    config.save_pretrained(out_dir)
    with torch.device("meta"):
        shapes = named_weight_shapes(DecoderForCausalLM(load_model_config(out_dir)))
    # Plan the shards from the shapes, then write each from fresh device tensors (host RAM holds one shard).
    element_size = torch.empty((), dtype=dtype).element_size()
    shard_names: list[list[str]] = [[]]
    shard_bytes = 0
    for name, (tensor_shape, _) in shapes.items():
        size = element_size * int(np.prod(tensor_shape))
        if shard_bytes and shard_bytes + size > max_shard_bytes:
            shard_names.append([])
            shard_bytes = 0
        shard_names[-1].append(name)
        shard_bytes += size
    generator = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    for index, names in enumerate(shard_names):
        shard = {}
        for name in names:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shapes[name][0], dtype=dtype, device=device)
            else:
                tensor = torch.randn(shapes[name][0], dtype=dtype, device=device, generator=generator).mul_(0.02)
            shard[name] = tensor.cpu()
        file_name = f"model-{index + 1:05d}-of-{len(shard_names):05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
    index_json = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return out_dir


def build_word_level_tokenizer(out_dir: Path, vocab_size: int):
    """A tokenizer with one word per id ("t0", "t1", ...), so any sampled id decodes; special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: index for index, token in enumerate(specials)}
    vocab.update({f"t{index}": index for index in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 3 upward: never a special token, so no prompt contains EOS.
    return torch.randint(3, vocab_size, (num_prompts, input_len), generator=generator).tolist()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="build a random-weight benchmark checkpoint of a named shape")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    cli = parser.parse_args()
    build_checkpoint(cli.out_dir, SHAPES[cli.shape], getattr(torch, cli.dtype),
                     "cuda" if torch.cuda.is_available() else "cpu", seed=0)
    print(cli.out_dir)
