"""The Megatron backend on two GPUs (NCCL, bf16): PP=2 x VPP=2 trains as PP=1 on one GPU and its torch_dist
checkpoint loads at PP=1 with the same weights and outputs, the CUDA twin of test_megatron_virtual_pipeline.py's
trainer test (there over gloo on the CPU); CP=2 trains as CP=1, the twin of test_megatron_parallel.py's. Skipped
unless two GPUs are visible."""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def test_pp2_vpp2_on_two_gpus_trains_as_pp1(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.backends.megatron_utils.test_virtual_pipeline import check_interleaved_against_one_stage

    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", num_hidden_layers=4, seed=5)
    # bf16 (the GPU's varlen flash attention takes no fp32) with fp32 master weights and gradient reduction: the
    # two layouts round differently, so the steps agree to bf16 precision; the checkpoint's weights load exactly.
    check_interleaved_against_one_stage(checkpoint, tmp_path / "save", {"device": "cuda", "bf16": True}, rel=2e-2,
                                        atol=2e-2, outputs_atol=2e-2)


def test_cp2_on_two_gpus_trains_as_cp1(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.backends.megatron_utils.test_parallel import check_cp2_trainer_against_cp1

    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", num_hidden_layers=4)
    # bf16: CP=1 runs the varlen flash kernel, CP=2 sdpa per chunk; they round differently
    check_cp2_trainer_against_cp1(checkpoint, {"device": "cuda", "bf16": True}, rel=2e-2, atol=2e-2)
