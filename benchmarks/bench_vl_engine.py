"""GPU benchmark of the built-in engine serving a vision-language model against the peer baseline, transformers
`generate` with the same images: a Qwen2.5-VL-3B-shaped random model in bf16 (or `--model-path` a real
Qwen2.5-VL / Qwen3-VL checkpoint), `--num-prompts` prompts of one image each (odd sizes, seeded), `--max-new-tokens`
greedy tokens each, EOS ignored.

The engine gets every request at once (continuous batching, the vision tower batched per step, decode CUDA graphs);
transformers runs the prompts in padded batches of `--hf-batch-size` (left padding). Prints both in output tokens per
second, the ratio, and the agreement of the first greedy tokens; summary card and a JSON last line.

    python benchmarks/bench_vl_engine.py                       # Qwen2.5-VL-3B shape, 64 prompts x 128 tokens
    python benchmarks/bench_vl_engine.py --model-path /models/Qwen3-VL-4B-Instruct --num-prompts 128

Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.engine.engine import Engine
from slime.utils.image_policy import IMAGE_PLACEHOLDER, load_vl_processor
from slime.utils.tiny_vl_model import build_tiny_vl_model

QWEN25_VL_3B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=128000,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
)
TEXT = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}How many shapes are there?<|im_end|>\n<|im_start|>assistant\n"


def images(num: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = rng.integers(180, 420, size=(num, 2))
    return [Image.fromarray(rng.integers(0, 256, size=(int(h), int(w), 3), dtype=np.uint8)) for h, w in sizes]


def run_engine(path, prompts, ids, max_new_tokens):
    engine = Engine(str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.6)
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    warm = engine.add_request(ids, dict(params, max_new_tokens=4), images=[prompts[0]], incremental=False)
    while not any(o.rid == warm and o.finished for o in engine.step()):
        pass
    torch.cuda.synchronize()
    start = time.perf_counter()
    rids = [engine.add_request(ids, params, images=[image], incremental=False) for image in prompts]
    finished = {}
    while len(finished) < len(rids):
        finished.update({o.rid: o.output_token_ids for o in engine.step() if o.finished})
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.shutdown()
    return [finished[rid] for rid in rids], seconds


def run_hf(path, processor, prompts, max_new_tokens, batch_size):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    outputs, seconds = [], 0.0
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        encoded = [processor.encode(TEXT, [image]) for image in batch]
        width = max(len(e.input_ids) for e in encoded)
        pad = lambda values, fill: [fill] * (width - len(values)) + values
        input_ids = torch.tensor([pad(e.input_ids, 0) for e in encoded]).cuda()
        attention_mask = torch.tensor([pad([1] * len(e.input_ids), 0) for e in encoded]).cuda()
        types = torch.tensor([pad(e.mm_token_type_ids, 0) for e in encoded]).cuda()
        pixel_values = torch.cat([e.pixel_values for e in encoded]).cuda()
        grids = torch.cat([e.image_grid_thw for e in encoded]).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, mm_token_type_ids=types,
                             pixel_values=pixel_values, image_grid_thw=grids, do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
        torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        outputs += out[:, width:].tolist()
    return outputs, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="a Qwen2.5-VL / Qwen3-VL checkpoint (default: random 3B shape)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    path = Path(args.model_path) if args.model_path else build_tiny_vl_model(
        Path("/tmp/bench_vl_3b"), "qwen2_5_vl", initializer_range=0.02, device="cuda", dtype="bfloat16",
        **QWEN25_VL_3B)
    processor = load_vl_processor(path)
    prompts = images(args.num_prompts)
    ids = processor.tokenizer(TEXT)["input_ids"]
    num_tokens = args.num_prompts * args.max_new_tokens
    engine_outputs, engine_seconds = run_engine(path, prompts, ids, args.max_new_tokens)
    result = {"bench": "vl_engine", "model": str(args.model_path or "qwen2.5-vl-3b-shape (random)"),
              "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
              "engine_tok_s": round(num_tokens / engine_seconds, 1), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    if not args.skip_hf:
        torch.cuda.empty_cache()
        hf_outputs, hf_seconds = run_hf(path, processor, prompts, args.max_new_tokens, args.hf_batch_size)
        result["hf_generate_tok_s"] = round(num_tokens / hf_seconds, 1)
        result["ratio"] = round(hf_seconds / engine_seconds, 2)
        # bf16 greedy paths drift apart after a near-tie: report how many leading tokens agree (median)
        agree = sorted(next((i for i, (a, b) in enumerate(zip(e, h)) if a != b), len(e))
                       for e, h in zip(engine_outputs, hf_outputs))
        result["median_leading_tokens_equal"] = agree[len(agree) // 2]
    print(f"engine: {result['engine_tok_s']} output tok/s"
          + (f"; transformers generate: {result['hf_generate_tok_s']} tok/s; ratio {result['ratio']}x; "
             f"median leading greedy tokens equal {result['median_leading_tokens_equal']}" if not args.skip_hf else ""))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
