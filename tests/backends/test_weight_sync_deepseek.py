"""Weight sync of the DeepSeek-V3 family (multi-head latent attention) from the FSDP trainer into a REAL engine server
process, on every route in turn: tensor handles, gloo broadcast, a full disk version and a delta disk version. The
trainer sends the 7 MLA tensors of every layer (Moonlight: q_proj instead of q_a_proj / q_a_layernorm / q_b_proj),
q_a_proj and kv_a_proj_with_mqa in one bucket, and never the router's correction bias; after each push of freshly
trained weights the engine's log-probs of its own sampled tokens equal the trainer's (fp32, < 1e-4): its absorbed
attention follows kv_b_proj."""

import httpx
import pytest
import torch
import torch.distributed as dist

from slime.backends.push_pipeline import iter_buckets
from slime.engine.server.launch import launch_server
from tests.backends.test_weight_sync_glm import _engine_sample, _trainer_log_probs
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer
from tests.helpers.mla_checkpoints import build_mla_checkpoint

MLA_TENSORS = {
    "deepseek_v3": ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                    "o_proj"],
    "moonlight": ["q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"],
}


@pytest.fixture(params=list(MLA_TENSORS))
def setup(request, tmp_path):
    checkpoint, _ = build_mla_checkpoint(tmp_path / "model", request.param, seed=6, initializer_range=0.1)
    server = launch_server(checkpoint, extra_args=["--device", "cpu", "--weights-dir-allowlist", str(tmp_path)],
                           log_path=tmp_path / "engine.log", env={"OMP_NUM_THREADS": "1"})
    yield request.param, checkpoint, server.url, tmp_path
    server.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_route_carries_the_mla_tensors(setup):
    variant, checkpoint, url, tmp_path = setup
    trainer = make_trainer(make_args(
        checkpoint, "--lr", "3e-2", "--micro-batch-size", "4", "--update-weight-buffer-size", "2000",
        "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "pushes"),
        "--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", str(tmp_path / "local")))
    sent = [name for name, _ in trainer.backend.hf_weights(None)]
    for layer in range(3):
        attention = {name.split(".")[-2] for name in sent if name.startswith(f"model.layers.{layer}.self_attn.")}
        assert attention == set(MLA_TENSORS[variant])
    assert not any(name.endswith("e_score_correction_bias") for name in sent)
    buckets = [[name for name, _ in bucket] for bucket, _ in iter_buckets(trainer.backend.hf_weights(None), 2000)]
    assert len(buckets) > 6
    for layer in range(3 if variant == "deepseek_v3" else 0):
        prefix = f"model.layers.{layer}.self_attn."
        assert any({prefix + "q_a_proj.weight", prefix + "kv_a_proj_with_mqa.weight"} <= set(b) for b in buckets)
    stale_ids, stale, _ = _engine_sample(url)
    for version, mode in enumerate(("tensor", "distributed", "disk", "disk"), start=1):  # disk: full, then delta
        trainer.train(version, make_train_data(8, vocab_size=300, seed=version))
        trainer.update_weights([url], weight_version=str(version), mode=mode)
        output_ids, log_probs, engine_version = _engine_sample(url)
        assert engine_version == str(version)
        torch.testing.assert_close(torch.tensor(log_probs), _trainer_log_probs(trainer, output_ids), rtol=0,
                                   atol=1e-4, msg=lambda text, mode=mode, version=version: f"{mode} push #{version}: {text}")
    assert output_ids != stale_ids or (torch.tensor(log_probs) - torch.tensor(stale)).abs().max() > 1e-3
    assert httpx.get(url + "/health", timeout=30, trust_env=False).status_code == 200
