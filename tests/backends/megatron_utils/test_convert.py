"""The checkpoint converters: HF -> torch_dist written by 2 tensor-parallel processes (torchrun) -> HF read back at
TP=1 is bit for bit the original (the torch_dist reshard included), with config and tokenizer files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
REPO = Path(__file__).resolve().parents[3]


def _run(*command):
    result = subprocess.run([sys.executable, *map(str, command)], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]


def test_hf_to_torch_dist_at_tp2_and_back_is_bit_exact(tmp_path):
    from safetensors.torch import load_file

    from slime.utils.misc import find_free_port
    from slime.utils.tiny_model import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", arch="qwen2", tie_word_embeddings=False, vocab_size=300)
    _run("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", find_free_port(),
         "tools/convert_hf_to_torch_dist.py", "--hf-checkpoint", hf, "--save", tmp_path / "dist",
         "--tensor-model-parallel-size", "2", "--num-layers", "2")  # a model-shape flag, as recipes pass them
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text() == "release"  # slime's converter's
    assert (tmp_path / "dist" / "release" / "config.json").is_file()
    _run("tools/convert_torch_dist_to_hf.py", "--input-dir", tmp_path / "dist", "--output-dir", tmp_path / "back")
    original, converted = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" /
                                                                                   "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    assert {p.name for p in (tmp_path / "back").iterdir()} >= {"config.json", "tokenizer.json"}
    assert not (tmp_path / "back" / "meta.json").exists()
