"""Weight sync of the GLM families from the FSDP trainer into a REAL engine server process, on every route in turn:
tensor handles, gloo broadcast, a full disk version and a delta disk version (through the engine's local
checkpoint). After each push of freshly trained weights the engine's log-probs of its own sampled tokens equal the
trainer's (fp32, < 1e-4). GLM-4 sends its fused `mlp.gate_up_proj`; GLM-4.5 its per-expert, shared-expert and float32
router names, and never the router's `e_score_correction_bias` (a buffer): the engine keeps the value it loaded,
while the trainer's folder on disk lacks it."""

import httpx
import pytest
import torch
import torch.distributed as dist

from slime.backends.packing import pack_samples
from slime.engine.server.launch import launch_server
from slime.utils import weight_delta
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer

PROMPT = [5, 17, 33, 42, 7, 9]
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


@pytest.fixture(params=["glm4", "glm4_moe"])
def setup(request, tmp_path):
    checkpoint = build_tiny_model(tmp_path / "model", arch=request.param, seed=6, initializer_range=0.1)
    server = launch_server(checkpoint, extra_args=["--device", "cpu", "--weights-dir-allowlist", str(tmp_path)],
                           log_path=tmp_path / "engine.log", env={"OMP_NUM_THREADS": "1"})
    yield request.param, checkpoint, server.url, tmp_path
    server.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine_sample(url):
    httpx.post(url + "/flush_cache", timeout=60, trust_env=False)
    response = httpx.post(url + "/generate", timeout=60, trust_env=False, json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3},
    }).json()
    meta = response["meta_info"]
    return response["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta["weight_version"]


def _trainer_log_probs(trainer, output_ids):
    with torch.no_grad():
        log_probs, _ = trainer.model.forward_micro_batch(pack_samples([PROMPT + output_ids], [len(output_ids)], [0]))
    return log_probs


def test_every_route_carries_the_family_and_keeps_the_correction_bias(setup):
    arch, checkpoint, url, tmp_path = setup
    trainer = make_trainer(make_args(
        checkpoint, "--lr", "3e-2", "--micro-batch-size", "4", "--update-weight-buffer-size", "20000",
        "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "pushes"),
        "--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", str(tmp_path / "local"),
        "--update-weight-disk-keep-files"))
    sent = {name for name, _ in trainer.backend.hf_weights(None)}
    assert ("model.layers.0.mlp.gate_up_proj.weight" in sent) == (arch == "glm4")
    if arch == "glm4_moe":
        assert {"model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
                "model.layers.1.mlp.gate.weight"} <= sent and BIAS not in sent
    stale_ids, stale, _ = _engine_sample(url)
    for version, mode in enumerate(("tensor", "distributed", "disk", "disk"), start=1):  # disk: full, then delta
        trainer.train(version, make_train_data(8, vocab_size=300, seed=version))
        trainer.update_weights([url], weight_version=str(version), mode=mode)
        output_ids, log_probs, engine_version = _engine_sample(url)
        assert engine_version == str(version)
        torch.testing.assert_close(torch.tensor(log_probs), _trainer_log_probs(trainer, output_ids), rtol=0,
                                   atol=1e-4, msg=lambda text, mode=mode, version=version: f"{mode} push #{version}: {text}")
    pushes = tmp_path / "pushes"
    assert "delta_encoding" not in weight_delta.read_index(pushes / "weight_v000003")["metadata"]  # the first: full
    assert weight_delta.read_index(pushes / "weight_v000004")["metadata"]["delta_encoding"] == "xor"
    assert not any(BIAS in weight_delta.read_index(pushes / f"weight_v00000{v}")["weight_map"] for v in (3, 4))
    # training moved the weights far enough that the stale engine would have disagreed
    assert output_ids != stale_ids or (torch.tensor(log_probs) - torch.tensor(stale)).abs().max() > 1e-3
