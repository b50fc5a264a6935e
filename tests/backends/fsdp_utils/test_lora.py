"""LoRA on the FSDP backend: adapter gradients equal a float64 reference on the merged weights W + s * B @ A; only
the adapters are in the optimizer and the base never moves; the reference pass (adapters disabled) equals the base
model; the merged export; checkpoints in PEFT's format that PEFT loads onto the base with the trainer's log-probs;
--lora-adapter-path; exact resume."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.backends.lora_adapter import PEFT_PREFIX, is_lora_name
from slime.backends.packing import pack_samples
from slime.utils.checkpoint_state import checkpoint_dir
from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer
from tests.helpers.lora_helpers import (
    LORA_FLAGS,
    SCALE,
    random_adapter,
    reference_log_probs,
    sample_mean_sft_loss,
    wide_tiny_checkpoint,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return wide_tiny_checkpoint(tmp_path_factory.mktemp("lora_tiny"))


@pytest.fixture(autouse=True)
def _destroy_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _adapter_shapes(trainer) -> dict[str, tuple]:
    return {name.removeprefix("hf_model."): tuple(p.shape) for name, p in trainer.model.named_parameters()
            if is_lora_name(name)}


@torch.no_grad()
def _set_adapter(trainer, adapter: dict[str, torch.Tensor]) -> None:
    for name, param in trainer.model.named_parameters():
        key = name.removeprefix("hf_model.")
        if key in adapter:
            (param.to_local() if isinstance(param, DTensor) else param).copy_(adapter[key])


def _trainer_log_probs(trainer, data) -> list[torch.Tensor]:
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(len(data["tokens"]))))
    log_probs, _ = trainer.backend.forward_only([packed])[0]
    return list(torch.split(log_probs, data["response_lengths"]))


def test_adapter_gradients_equal_the_merged_weight_reference_and_only_adapters_train(checkpoint):
    data = make_train_data(4, vocab_size=300, seed=3)
    trainer = make_trainer(make_args(checkpoint, *LORA_FLAGS, "--loss-type", "sft_loss", "--micro-batch-size", "3",
                                     "--lr", "1e-3", "--clip-grad", "0"))  # the raw gradients reach the step
    adapter = random_adapter(_adapter_shapes(trainer), seed=7)
    assert len(adapter) == 2 * 7 * 2  # 7 linear layers per decoder layer, 2 layers
    _set_adapter(trainer, adapter)
    optimizer = trainer.backend.optimizer
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    lora = {name: p for name, p in trainer.model.named_parameters() if is_lora_name(name)}
    assert optimized == {id(p) for p in lora.values()}
    before = full_params(trainer)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append(
        {name: None if p.grad is None else p.grad.full_tensor().clone()
         for name, p in trainer.model.named_parameters()}))
    metrics = trainer.train(0, data)

    log_probs, leaves = reference_log_probs(checkpoint, adapter, SCALE, data["tokens"], data["response_lengths"])
    loss = sample_mean_sft_loss(log_probs, data["loss_masks"])
    loss.backward()
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, grad in grads[0].items():
        key = name.removeprefix("hf_model.")
        if is_lora_name(key):
            assert leaves[key].grad.abs().max() > 1e-4, key  # every adapter takes part
            torch.testing.assert_close(grad.double(), leaves[key].grad, rtol=1e-5, atol=1e-6, msg=key)
        else:
            assert grad is None, name  # the base is frozen: no gradient
    after = full_params(trainer)
    for name, value in before.items():
        if is_lora_name(name):
            assert not torch.equal(after[name], value), name
        else:
            assert torch.equal(after[name], value), name
    assert {id(p) for p in optimizer.state} == {id(p) for p in lora.values()}


def test_reference_pass_is_the_base_model(checkpoint):
    data = make_train_data(4, vocab_size=300, seed=4)
    trainer = make_trainer(make_args(checkpoint, *LORA_FLAGS, "--use-kl-loss", "--kl-loss-coef", "0.1"),
                           with_ref=True)
    assert trainer.with_ref and "ref" not in trainer.snapshot.tags
    _set_adapter(trainer, random_adapter(_adapter_shapes(trainer), seed=8))
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(4)))
    ref = trainer._log_probs_with("ref", [[packed]], 4)
    base, _ = reference_log_probs(checkpoint, {}, SCALE, data["tokens"], data["response_lengths"])
    adapted = _trainer_log_probs(trainer, data)
    for r, b, a in zip(ref, base, adapted):
        torch.testing.assert_close(r.double(), b.detach(), rtol=1e-5, atol=1e-5)
        assert (a - r).abs().max() > 1e-2  # the adapters are back on after the pass, and they matter


def test_merged_export_is_base_plus_scaled_product(checkpoint):
    from slime.backends.fsdp_utils.model import read_hf_weights

    trainer = make_trainer(make_args(checkpoint, *LORA_FLAGS))
    adapter = random_adapter(_adapter_shapes(trainer), seed=9)
    _set_adapter(trainer, adapter)
    exported = dict(trainer.backend.hf_weights(None))
    base = read_hf_weights(str(checkpoint))
    assert not any(is_lora_name(name) for name in exported)
    assert exported.keys() == base.keys()
    for name, value in exported.items():
        layer = name.removesuffix(".weight")
        expected = base[name]
        if layer + ".lora_A.weight" in adapter:
            expected = (base[name].double() + SCALE * adapter[layer + ".lora_B.weight"].double()
                        @ adapter[layer + ".lora_A.weight"].double()).float()
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6, msg=name)


def test_checkpoint_is_a_peft_adapter_that_peft_loads_with_the_trainers_log_probs(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    data = make_train_data(4, vocab_size=300, seed=5)
    save = tmp_path / "ckpt"
    trainer = make_trainer(make_args(checkpoint, *LORA_FLAGS, "--save", save, "--lr", "1e-2",
                                     "--save-hf", tmp_path / "hf_{rollout_id}"))
    _set_adapter(trainer, random_adapter(_adapter_shapes(trainer), seed=10))
    trainer.train(0, data)
    trainer.save_model(0, run_state={"data_source": {}})
    trained = _trainer_log_probs(trainer, data)
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_0", dtype=torch.float32)  # --save-hf: merged
    with torch.no_grad():
        for sample, response_length, expected in zip(data["tokens"], data["response_lengths"], trained):
            ids = torch.tensor([sample])
            log_probs = torch.log_softmax(merged_model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(log_probs[-response_length:], expected, rtol=1e-5, atol=1e-5)
    folder = checkpoint_dir(save, 0) / "adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    from safetensors.torch import load_file

    keys = load_file(str(folder / "adapter_model.safetensors")).keys()
    assert f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 28

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        for sample, response_length, expected in zip(data["tokens"], data["response_lengths"], trained):
            ids = torch.tensor([sample])
            log_probs = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(log_probs[-response_length:], expected, rtol=1e-5, atol=1e-5)


def test_adapter_path_starts_from_a_saved_adapter_and_resume_is_exact(checkpoint, tmp_path):
    save = tmp_path / "ckpt"
    extra = (*LORA_FLAGS, "--lr", "1e-2", "--lr-warmup-iters", "2", "--save", save, "--micro-batch-size", "2")
    data = [make_train_data(8, vocab_size=300, seed=s, num_steps=2) for s in (11, 12)]
    trainer = make_trainer(make_args(checkpoint, *extra))
    _set_adapter(trainer, random_adapter(_adapter_shapes(trainer), seed=11))
    trainer.train(0, data[0])
    trainer.save_model(0, run_state={"data_source": {}})
    saved = full_params(trainer)
    uninterrupted = trainer.train(1, data[1])
    expected = full_params(trainer)
    dist.destroy_process_group()

    started = make_trainer(make_args(checkpoint, *LORA_FLAGS, "--lora-adapter-path",
                                     checkpoint_dir(save, 0) / "adapter"))
    for name, value in full_params(started).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    dist.destroy_process_group()

    resumed = make_trainer(make_args(checkpoint, *extra, "--load", save))
    assert resumed.start_rollout_id == 1
    metrics = resumed.train(1, data[1])
    assert metrics["train/loss"] == uninterrupted["train/loss"]
    for name, value in full_params(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_targets_the_model_lacks_are_refused_and_a_fused_gate_up_is_one_layer(tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.lora import apply_lora
    from slime.utils.tiny_model import build_tiny_model

    qwen3 = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "qwen3", arch="qwen3"))
    with pytest.raises(ValueError, match="has no nn.Linear named gate_up_proj"):
        apply_lora(qwen3, ["gate_up_proj", "q_proj"], 4, 8, 0.0)
    glm4 = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "glm4", arch="glm4"))
    adapted = apply_lora(glm4, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 4, 8,
                         0.0)
    assert "model.layers.0.mlp.gate_up_proj" in adapted and len(adapted) == 6 * glm4.config.num_hidden_layers
