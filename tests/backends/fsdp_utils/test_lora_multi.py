"""Several LoRA adapters in one FSDP trainer (--lora-adapter-key / --lora-adapter-names): one packed micro-batch
mixing the adapters' samples gives each sample its own adapter's log-probs and each adapter the gradient of its own
samples only (float64 reference on the merged weights, per adapter); each adapter is clipped on its own norm; the
checkpoint holds one PEFT folder per adapter and resumes exactly; the reference pass is the base model for every
sample, and a forward that does not say each token's adapter is refused."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.backends.lora_adapter import is_lora_name, load_peft_folder, split_by_adapter
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

NAMES = ["math", "code"]
MULTI = (*LORA_FLAGS, "--lora-adapter-key", "task", "--lora-adapter-names", ",".join(NAMES))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return wide_tiny_checkpoint(tmp_path_factory.mktemp("lora_multi"))


@pytest.fixture(autouse=True)
def _destroy_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _key(name: str) -> str:
    return name.removeprefix("hf_model.")


@torch.no_grad()
def _randomise(trainer, seed: int) -> dict[str, torch.Tensor]:
    """Non-zero values for every adapter (each its own); returns them under the trainer's (multi) names."""
    shapes = {_key(name): tuple(p.shape) for name, p in trainer.model.named_parameters() if is_lora_name(name)}
    values = random_adapter(shapes, seed=seed)
    for name, param in trainer.model.named_parameters():
        if _key(name) in values:
            (param.to_local() if isinstance(param, DTensor) else param).copy_(values[_key(name)])
    return values


def with_adapters(data: dict, adapters: list[int]) -> dict:
    return {**data, "lora_adapters": adapters}


def test_mixed_micro_batch_gives_each_sample_its_adapter_and_each_adapter_its_gradient(checkpoint):
    data = with_adapters(make_train_data(4, vocab_size=300, seed=3), [0, 1, 1, 0])
    trainer = make_trainer(make_args(checkpoint, *MULTI, "--loss-type", "sft_loss", "--micro-batch-size", "4",
                                     "--lr", "1e-3", "--clip-grad", "0"))  # one micro-batch mixing both adapters
    parts = split_by_adapter(_randomise(trainer, seed=5), NAMES)
    assert len(parts["math"]) == len(parts["code"]) == 2 * 7 * 2  # 7 linears per layer, 2 layers, A and B
    grads = []
    trainer.backend.optimizer.register_step_pre_hook(lambda *_: grads.append(
        {_key(name): p.grad.full_tensor().clone() for name, p in trainer.model.named_parameters()
         if p.grad is not None}))
    metrics = trainer.train(0, data)

    log_probs, leaves = [None] * 4, {}
    for index, name in enumerate(NAMES):
        members = [i for i, a in enumerate(data["lora_adapters"]) if a == index]
        result, leaves[name] = reference_log_probs(checkpoint, parts[name], SCALE, [data["tokens"][i] for i in members],
                                                   [data["response_lengths"][i] for i in members])
        for i, lp in zip(members, result):
            log_probs[i] = lp
    loss = sample_mean_sft_loss(log_probs, data["loss_masks"])
    loss.backward()
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert set(grads[0]) == {_key(name) for name, _ in trainer.model.named_parameters() if is_lora_name(name)}
    for name in NAMES:
        for key, leaf in leaves[name].items():
            layer, kind, suffix = key.rsplit(".", 2)
            assert leaf.grad.abs().max() > 1e-4, key
            torch.testing.assert_close(grads[0][f"{layer}.{kind}.{name}.{suffix}"].double(), leaf.grad, rtol=1e-5,
                                       atol=1e-6, msg=f"{name}: {key}")


def test_one_adapters_samples_leave_the_other_untouched_and_clipping_is_per_adapter(checkpoint):
    data = with_adapters(make_train_data(4, vocab_size=300, seed=4), [1, 1, 1, 1])  # code only
    trainer = make_trainer(make_args(checkpoint, *MULTI, "--loss-type", "sft_loss", "--lr", "1e-2"))
    _randomise(trainer, seed=6)
    before = full_params(trainer)
    trainer.train(0, data)
    after = full_params(trainer)
    for name, value in before.items():
        moved = not torch.equal(after[name], value)
        assert moved == (".code." in name), name  # math's adapter, and the base, never move
    # per-adapter clipping: a norm computed over both adapters would clip code's step differently
    trainer.backend.zero_grad()
    for param in trainer.model.parameters():
        if param.requires_grad:
            param.grad = torch.ones_like(param) * (3.0 if ".math." in _names(trainer)[id(param)] else 0.001)
    norms = {name: sum(float(p.grad.full_tensor().double().square().sum()) for key, p in
                       trainer.model.named_parameters() if f".{name}." in key and p.grad is not None) ** 0.5
             for name in NAMES}
    total = trainer.backend.clip_grad_norm(1.0)
    assert total == pytest.approx((norms["math"] ** 2 + norms["code"] ** 2) ** 0.5, rel=1e-5)
    for key, param in trainer.model.named_parameters():
        if param.requires_grad:
            expected = 3.0 / norms["math"] if ".math." in key else 0.001  # code's norm is below 1: unclipped
            assert float(param.grad.full_tensor().abs().max()) == pytest.approx(expected, rel=1e-5), key


def _names(trainer) -> dict[int, str]:
    return {id(p): name for name, p in trainer.model.named_parameters()}


def test_checkpoint_holds_a_peft_folder_per_adapter_and_resumes_exactly(checkpoint, tmp_path):
    save = tmp_path / "ckpt"
    extra = (*MULTI, "--lr", "1e-2", "--save", save, "--micro-batch-size", "2")
    data = [with_adapters(make_train_data(8, vocab_size=300, seed=s, num_steps=2), [0, 1] * 4) for s in (21, 22)]
    trainer = make_trainer(make_args(checkpoint, *extra))
    _randomise(trainer, seed=7)
    trainer.train(0, data[0])
    trainer.save_model(0, run_state={"data_source": {}})
    saved = split_by_adapter({_key(k): v for k, v in full_params(trainer).items() if is_lora_name(k)}, NAMES)
    uninterrupted = trainer.train(1, data[1])
    expected = full_params(trainer)
    dist.destroy_process_group()

    for name in NAMES:
        config, tensors = load_peft_folder(checkpoint_dir(save, 0) / "adapter" / name)
        assert config["r"] == 4 and sorted(tensors) == sorted(saved[name])
        for key, tensor in tensors.items():
            torch.testing.assert_close(tensor, saved[name][key], rtol=0, atol=0, msg=key)
    resumed = make_trainer(make_args(checkpoint, *extra, "--load", save))
    metrics = resumed.train(1, data[1])
    assert metrics["train/loss"] == uninterrupted["train/loss"]
    for name, value in full_params(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_reference_pass_is_the_base_model_whatever_each_samples_adapter(checkpoint):
    from slime.backends.packing import pack_samples
    from slime.backends.schedule import train_schedule

    data = with_adapters(make_train_data(4, vocab_size=300, seed=8), [0, 1, 0, 1])
    trainer = make_trainer(make_args(checkpoint, *MULTI, "--use-kl-loss", "--kl-loss-coef", "0.1"), with_ref=True)
    _randomise(trainer, seed=9)
    schedule = train_schedule(trainer.args, data, trainer.backend)
    ref = trainer._log_probs_with("ref", schedule, len(data["tokens"]))
    base, _ = reference_log_probs(checkpoint, {}, SCALE, data["tokens"], data["response_lengths"])
    for got, expected in zip(ref, base):
        torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    packed = pack_samples(data["tokens"], data["response_lengths"], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="names none per token"):  # a forward that does not say the adapters
        trainer.backend.forward_only([packed])
