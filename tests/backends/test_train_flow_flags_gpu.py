"""GPU-only checks of slime's trainer-side flags (skipped without CUDA): --reset-optimizer-states with the fused
AdamW (its step counts live on the device), and a bf16 run with freezing, --use-stateless-adam,
--use-rollout-entropy and --save-debug-train-data together."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpu_flags"), arch="qwen3", seed=4, vocab_size=300,
                            hidden_size=256, intermediate_size=512)


def test_reset_optimizer_states_with_fused_adamw(checkpoint):
    from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer

    data = [make_train_data(8, vocab_size=300, seed=s, num_steps=2) for s in (1, 2)]
    reset = make_trainer(make_args(checkpoint, "--lr", "1e-3", "--reset-optimizer-states", device="cuda"))
    manual = make_trainer(make_args(checkpoint, "--lr", "1e-3", device="cuda"))
    assert reset.backend.optimizer.defaults["fused"]
    for trainer in (reset, manual):
        trainer.train(0, data[0])
    manual.backend.optimizer.state.clear()
    for trainer in (reset, manual):
        trainer.train(1, data[1])
    reset_params, manual_params = full_params(reset), full_params(manual)
    for name in reset_params:
        torch.testing.assert_close(reset_params[name], manual_params[name], rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_run_with_freezing_stateless_adam_entropy_and_train_dump(checkpoint, tmp_path):
    from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer

    trainer = make_trainer(make_args(checkpoint, "--lr", "1e-3", "--freeze-params-name-list", "embed_tokens",
                                     "--use-stateless-adam", "--no-save-optim", "--use-rollout-entropy",
                                     "--use-kl-loss", "--ref-load", checkpoint, "--save-debug-train-data",
                                     str(tmp_path / "train_{rollout_id}.pt"), device="cuda"), with_ref=True)
    before = full_params(trainer)
    metrics = trainer.train(0, make_train_data(8, vocab_size=300, seed=3, num_steps=2))
    after = full_params(trainer)
    assert torch.equal(before["hf_model.model.embed_tokens.weight"], after["hf_model.model.embed_tokens.weight"])
    assert not torch.equal(before["hf_model.model.norm.weight"], after["hf_model.model.norm.weight"])
    assert 0 < metrics["rollout/entropy"] == pytest.approx(metrics["rollout/ref_entropy"], rel=1e-2)
    payload = torch.load(tmp_path / "train_0.pt", weights_only=True)
    assert len(payload["samples"]) == 8 and all(s["entropy"].device.type == "cpu" for s in payload["samples"])
