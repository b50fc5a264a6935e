"""Convert a Megatron checkpoint into a Hugging Face safetensors folder (slime's tool of the same name): a --save
folder of --train-backend megatron or of slime's Megatron (Megatron-LM's layout: its
latest_checkpointed_iteration.txt picks the iteration, --ckpt-step another one), one of its `iter_%07d` / `release`
folders, or the output of tools/convert_hf_to_torch_dist.py. One process: the checkpoint is resharded to
TP = PP = 1 on load, whatever layout wrote it.

    python tools/convert_torch_dist_to_hf.py --input-dir /ckpt/iter_0000099 --output-dir /models/step99_hf \\
        [--origin-hf-dir /models/Qwen3-4B]

--origin-hf-dir gives config.json and the tokenizer (default: the checkpoint folder's own copies; slime's
checkpoints have none, so pass it for them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-dir", required=True,
                        help="the Megatron checkpoint: a save folder (its tracker file) or an iter_*/release folder")
    parser.add_argument("--ckpt-step", type=int, default=None, help="the iteration of a save folder to convert")
    parser.add_argument("--output-dir", required=True, help="the HF folder to write")
    parser.add_argument("--origin-hf-dir", default=None, help="config.json and tokenizer source (default: input)")
    parser.add_argument("-f", "--force", action="store_true", help="overwrite a non-empty --output-dir")
    args = parser.parse_args(argv)
    from slime.utils.megatron_layout import MegatronLayoutError, checkpoint_folder, is_megatron_root

    try:
        folder = Path(args.input_dir)
        if is_megatron_root(folder) or args.ckpt_step is not None:
            folder = checkpoint_folder(folder, args.ckpt_step, "--input-dir")
    except MegatronLayoutError as exc:
        parser.error(str(exc))
    args.checkpoint = folder
    source = Path(args.origin_hf_dir or folder)
    if not (source / "config.json").is_file():
        parser.error(f"{source} has no config.json (slime's checkpoints carry none): pass --origin-hf-dir, the HF "
                     "folder of the model's architecture")
    args.source = source
    output = Path(args.output_dir)
    if output.exists() and any(output.iterdir()) and not args.force:
        parser.error(f"--output-dir {output} is not empty; pass -f to overwrite")
    return args


def main(argv=None) -> None:
    import torch

    from slime.backends.megatron_utils.checkpoint import load_model_weights
    from slime.backends.megatron_utils.cpu_shim import apply_cpu_shim
    from slime.backends.megatron_utils.hf_config import load_hf_config
    from slime.backends.megatron_utils.hf_weights import save_hf_checkpoint
    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.process_group import init_default_group
    from slime.utils.misc import find_free_port

    opts = parse_args(argv)
    source = opts.source
    layout = argparse.Namespace(
        hf_checkpoint=str(source), tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, sequence_parallel=False, recompute_granularity=None, recompute_method=None,
        recompute_num_layers=None, bf16=False, seed=0, custom_model_provider_path=None, moe_router_dtype=None,
        moe_grouped_gemm=False, moe_token_dispatcher_type=None)  # either expert layout loads the same entries
    cpu = torch.device("cpu")  # conversion copies tensors: the host is enough and works everywhere
    apply_cpu_shim()
    init_default_group(cpu, 0, 1, "127.0.0.1", find_free_port())
    init_model_parallel(layout, cpu)
    hf_config = load_hf_config(source)
    chunks = [build_gpt_model(layout, hf_config, cpu)]
    load_model_weights(opts.checkpoint, chunks)
    save_hf_checkpoint(chunks, hf_config, opts.output_dir, source)
    print(f"wrote {opts.output_dir}")


if __name__ == "__main__":
    main()
