"""Convert a Hugging Face checkpoint into a Megatron checkpoint in Megatron-LM's layout, as slime's tool of the same
name writes it: `{save}/latest_checkpointed_iteration.txt` naming `release`, and `{save}/release/` a torch_dist
checkpoint with Transformer Engine's parameter names, sharded as the ranks of the given parallel layout write it
(torch_dist reshards on load, so any layout reads it; slime's Megatron reads it too).

    torchrun --nproc-per-node 2 tools/convert_hf_to_torch_dist.py --hf-checkpoint /models/Qwen3-4B \\
        --save /models/Qwen3-4B_torch_dist --tensor-model-parallel-size 2 [${MODEL_ARGS[@]}]

Also runs as a single process (`python tools/convert_hf_to_torch_dist.py ...`). The model is built from the
checkpoint's config.json: Megatron model-shape flags (slime's scripts/models/*.sh) are accepted and ignored. The
output is weights only (config and tokenizer files copied beside them): pass it as --ref-load or --load, or convert
it back with tools/convert_torch_dist_to_hf.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    from slime.config.flags_megatron import add_megatron_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", required=True, help="the Hugging Face folder to convert")
    parser.add_argument("--save", required=True, help="the Megatron checkpoint folder to write (its release/)")
    parser.add_argument("--seed", type=int, default=1234)
    add_megatron_arguments(parser)
    args, _ = parser.parse_known_args(argv)
    if args.num_layers_per_virtual_pipeline_stage or args.num_virtual_stages_per_pipeline_rank:
        parser.error("virtual pipeline stages are not supported by the converter; drop the flag")
    args.virtual_pipeline_model_parallel_size = None
    args.custom_model_provider_path = None  # the converter builds the model of config.json
    args.bf16 = False  # the HF weights are copied as they are, in fp32 (lossless for bf16 checkpoints)
    # The trainer's MoE flags (slime/config/flags_moe.py): conversion runs no router and no experts, and both
    # expert layouts write the same torch_dist entries.
    args.moe_router_dtype = args.moe_token_dispatcher_type = None
    args.moe_grouped_gemm = False
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    layout = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world_size % layout:
        parser.error(f"{world_size} processes are not divisible by --tensor-model-parallel-size x "
                     f"--pipeline-model-parallel-size ({layout})")
    return args


def main(argv=None) -> None:
    import torch

    from slime.backends.megatron_utils.checkpoint import save_weights
    from slime.backends.megatron_utils.cpu_shim import apply_cpu_shim
    from slime.backends.megatron_utils.hf_config import load_hf_config
    from slime.backends.megatron_utils.hf_weights import load_hf_weights
    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.process_group import init_default_group
    from slime.utils.misc import find_free_port

    args = parse_args(argv)
    cpu = torch.device("cpu")  # conversion copies tensors: the host is enough and works everywhere
    apply_cpu_shim()
    init_default_group(cpu, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                       os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", find_free_port())))
    init_model_parallel(args, cpu)
    hf_config = load_hf_config(args.hf_checkpoint)
    chunks = [build_gpt_model(args, hf_config, cpu)]
    load_hf_weights(chunks, args.hf_checkpoint, hf_config)
    folder = save_weights(args.save, chunks, args, hf_config)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
