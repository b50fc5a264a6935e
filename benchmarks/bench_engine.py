"""Output-token throughput of slime's built-in engine (Python API, no HTTP) against Hugging Face transformers
`generate` on the same workload, in one process: random prompts of equal length, sampled at temperature 1.0, EOS
ignored so every request produces exactly --output-len tokens. Prints both rates, their ratio, a summary card and
a JSON last line.

    python benchmarks/bench_engine.py                         # CPU: tiny model, 16 prompts x 32 in, 64 out
    python benchmarks/bench_engine.py --preset qwen3-0.6b     # CUDA bf16: Qwen3-0.6B shape, 256 x 256 in, 256 out

The qwen3-0.6b preset uses random weights (the speed of a model does not depend on its values) and a synthetic
word-level tokenizer covering the full vocabulary, so nothing is downloaded. Not a quality benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS = {
    "tiny": dict(num_prompts=16, input_len=32, output_len=64, device="cpu", dtype="float32"),
    "qwen3-0.6b": dict(num_prompts=256, input_len=256, output_len=256, device="cuda", dtype="bfloat16"),
}
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--model-path", default=None, help="benchmark this checkpoint instead of building one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="measure the engine only (no ratio)")
    args = parser.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu")
    return args


def build_checkpoint(preset: str, out_dir: Path, dtype: torch.dtype, seed: int) -> Path:
    if preset == "tiny":
        from slime.utils.tiny_model import build_tiny_model

        return build_tiny_model(out_dir, arch="qwen3", seed=seed)
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = build_word_level_tokenizer(out_dir, QWEN3_06B_SHAPE["vocab_size"])
    config = Qwen3Config(**QWEN3_06B_SHAPE, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
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


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_engine(model_path: Path, prompts, args) -> dict:
    from slime.engine.engine import Engine
    from slime.engine.sampling_params import SamplingParams

    engine = Engine(
        str(model_path),
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max(args.num_prompts, 1),
        seed=args.seed,
    )
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))  # warm-up
    synchronize(args.device)
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    synchronize(args.device)
    elapsed = time.perf_counter() - started
    num_output_tokens = sum(len(r["output_ids"]) for r in results)
    del engine
    return {"seconds": elapsed, "num_output_tokens": num_output_tokens}


def bench_hf(model_path: Path, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="sdpa")
    model.to(args.device).eval()
    input_ids = torch.tensor(prompts, device=args.device)
    attention_mask = torch.ones_like(input_ids)
    generate_kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
        max_new_tokens=args.output_len, min_new_tokens=args.output_len,
    )
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2], **{**generate_kwargs,
                       "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        synchronize(args.device)
        started = time.perf_counter()
        output = model.generate(input_ids, attention_mask=attention_mask, **generate_kwargs)
        synchronize(args.device)
        elapsed = time.perf_counter() - started
    num_output_tokens = int(output[:, input_ids.shape[1]:].numel())
    del model, output
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": elapsed, "num_output_tokens": num_output_tokens}


def main(argv=None) -> dict:
    import transformers

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_path = Path(args.model_path) if args.model_path else build_checkpoint(
            args.preset, Path(tmp) / "model", getattr(torch, args.dtype), args.seed
        )
        vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        # HF first: it frees its memory before the engine sizes its KV cache from what is free.
        hf = None if args.skip_hf else bench_hf(model_path, prompts, args)
        engine = bench_engine(model_path, prompts, args)

    expected_tokens = args.num_prompts * args.output_len
    engine_rate = engine["num_output_tokens"] / engine["seconds"]
    hf_rate = hf["num_output_tokens"] / hf["seconds"] if hf else None
    ratio = engine_rate / hf_rate if hf_rate else None
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    result = {
        "benchmark": "engine_vs_hf_generate",
        "preset": args.preset,
        "model": str(args.model_path or args.preset),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "device": args.device,
        "device_name": device_name,
        "dtype": args.dtype,
        "engine_output_tok_s": round(engine_rate, 1),
        "engine_seconds": round(engine["seconds"], 3),
        "engine_output_tokens": engine["num_output_tokens"],
        "hf_output_tok_s": round(hf_rate, 1) if hf_rate else None,
        "hf_seconds": round(hf["seconds"], 3) if hf else None,
        "hf_output_tokens": hf["num_output_tokens"] if hf else None,
        "ratio_engine_over_hf": round(ratio, 3) if ratio else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"engine: {engine_rate:,.1f} output tok/s "
          f"({engine['num_output_tokens']} tokens in {engine['seconds']:.2f} s)")
    if hf:
        print(f"hf generate: {hf_rate:,.1f} output tok/s ({hf['num_output_tokens']} tokens in {hf['seconds']:.2f} s)")
        print(f"ratio engine / hf: {ratio:.2f}x")
    if engine["num_output_tokens"] != expected_tokens:
        print(f"WARNING: engine produced {engine['num_output_tokens']} tokens, expected {expected_tokens}")
    print("=" * 64)
    print(f"| preset {args.preset}: {args.num_prompts} prompts x {args.input_len} in, {args.output_len} out")
    print(f"| device {args.device} ({device_name}), dtype {args.dtype}")
    print(f"| torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"| engine {result['engine_output_tok_s']} tok/s | hf {result['hf_output_tok_s']} tok/s "
          f"| ratio {result['ratio_engine_over_hf']}")
    print("=" * 64)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
