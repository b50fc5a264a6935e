"""slime's trainer-side flags on the FSDP train flow (one process): parameter freezing, --reset-optimizer-states,
--use-stateless-adam, --log-probs-max-tokens-per-gpu, --balance-by-flops, --use-rollout-entropy,
--save-debug-train-data and --ref-ckpt-step, each against an independent reference or an invariance. The Megatron backend's side:
test_megatron_trainer_flags.py; the flags' parse-time rules: test_trainer_flag_rules.py."""

from __future__ import annotations

import pytest
import torch

from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer

ENTROPY_SEEN = []


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_flags"), arch="qwen3", seed=5, vocab_size=300)


def _changed(before: dict, after: dict) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


def test_freeze_params_name_list_keeps_matches_fixed_without_optimizer_state(tiny_checkpoint):
    trainer = make_trainer(make_args(tiny_checkpoint, "--lr", "1e-2", "--freeze-params-name-list", "embed_tokens",
                                     r"layers\.0\."))
    before = full_params(trainer)
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    frozen = {name for name in before if "embed_tokens" in name or ".layers.0." in name}
    assert frozen and _changed(before, full_params(trainer)) == set(before) - frozen
    state_params = {id(param) for param in trainer.backend.optimizer.state}
    assert all((id(param) in state_params) == (name not in frozen) for name, param in trainer.model.named_parameters())
    pushed = dict(trainer.backend.hf_weights(None))  # frozen weights still go to the engines
    assert "model.embed_tokens.weight" in pushed and "model.layers.0.mlp.up_proj.weight" in pushed


def test_only_train_params_name_list_trains_the_matches_only(tiny_checkpoint):
    trainer = make_trainer(make_args(tiny_checkpoint, "--lr", "1e-2", "--only-train-params-name-list",
                                     r"layers\.1\.mlp"))
    before = full_params(trainer)
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    assert _changed(before, full_params(trainer)) == {name for name in before if ".layers.1.mlp." in name}


def test_a_freeze_pattern_that_matches_nothing_is_an_error(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"--freeze-params-name-list: 'output_layer' matches no parameter"):
        make_trainer(make_args(tiny_checkpoint, "--freeze-params-name-list", "embed_tokens", "output_layer"))


def test_reset_optimizer_states_equals_a_fresh_adamw_at_each_rollout(tiny_checkpoint):
    data = [make_train_data(4, vocab_size=300, seed=s, num_steps=2) for s in (2, 3)]
    algorithm = ("--lr", "1e-2", "--weight-decay", "0.1")
    reset = make_trainer(make_args(tiny_checkpoint, *algorithm, "--reset-optimizer-states"))
    manual = make_trainer(make_args(tiny_checkpoint, *algorithm))
    for trainer in (reset, manual):
        trainer.train(0, data[0])
    manual.backend.optimizer.state.clear()  # what a new AdamW starts from (a reset that did nothing would differ)
    for trainer in (reset, manual):
        trainer.train(1, data[1])
    reset_params, manual_params = full_params(reset), full_params(manual)
    for name in reset_params:
        torch.testing.assert_close(reset_params[name], manual_params[name], rtol=1e-5, atol=1e-7, msg=name)


def test_stateless_adam_equals_adamw_reset_before_every_step(tiny_checkpoint):
    """slime's claim for StatelessAdam: one-step rollouts with the moments reset before each train the same
    (the reset itself is checked above)."""
    data = [make_train_data(4, vocab_size=300, seed=s) for s in (4, 5)]
    algorithm = ("--lr", "1e-2", "--weight-decay", "0.1", "--no-save-optim")
    stateless = make_trainer(make_args(tiny_checkpoint, *algorithm, "--use-stateless-adam"))
    reset = make_trainer(make_args(tiny_checkpoint, *algorithm, "--reset-optimizer-states"))
    for rollout_id, rollout in enumerate(data):
        for trainer in (stateless, reset):
            trainer.train(rollout_id, rollout)
    assert not stateless.backend.optimizer.state
    stateless_params, reset_params = full_params(stateless), full_params(reset)
    # Each step moves most weights by about lr (g / (|g| + eps)); only elements with |g| near eps, where float
    # rounding of g shows, may differ, and by far less than a step.
    for name in stateless_params:
        torch.testing.assert_close(stateless_params[name], reset_params[name], rtol=0, atol=1e-4, msg=name)


def _record_micro_batch_tokens(trainer) -> dict[str, list[int]]:
    seen = {"forward_only": [], "forward_backward": []}
    backend = trainer.backend
    for method in seen:
        original = getattr(backend, method)

        def spy(micro_batches, *rest, _original=original, _tokens=seen[method]):
            _tokens.extend(int(mb.input_ids.numel()) for mb in micro_batches)
            return _original(micro_batches, *rest)

        setattr(backend, method, spy)
    return seen


def test_token_budgets_and_flops_balance_change_the_micro_batches_not_the_loss(tiny_checkpoint):
    """--log-probs-max-tokens-per-gpu packs only the forward-only passes; --balance-by-flops packs ceil(tokens /
    --max-tokens-per-gpu) micro-batches per step by slime's cost model. The loss is the same for any packing."""
    import math

    data = make_train_data(8, vocab_size=300, seed=6, num_steps=2)
    budget = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--lr", "1e-3")
    default = make_trainer(make_args(tiny_checkpoint, *budget))
    large = make_trainer(make_args(tiny_checkpoint, *budget, "--log-probs-max-tokens-per-gpu", "400"))
    flops = make_trainer(make_args(tiny_checkpoint, *budget, "--balance-by-flops"))
    default_tokens, large_tokens, flops_tokens = map(_record_micro_batch_tokens, (default, large, flops))
    default_metrics, large_metrics, flops_metrics = (t.train(0, data) for t in (default, large, flops))
    assert max(default_tokens["forward_only"]) <= 24 and max(large_tokens["forward_backward"]) <= 24
    assert len(large_tokens["forward_only"]) == 2 < len(default_tokens["forward_only"])  # one per step's schedule
    assert sum(large_tokens["forward_only"]) == sum(len(t) for t in data["tokens"])
    step_tokens = [sum(len(t) for t in data["tokens"][:4]), sum(len(t) for t in data["tokens"][4:])]
    assert len(flops_tokens["forward_backward"]) == sum(math.ceil(n / 24) for n in step_tokens)
    for key in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/grad_norm"):
        assert large_metrics[key] == pytest.approx(default_metrics[key], rel=1e-4, abs=1e-6), key
        assert flops_metrics[key] == pytest.approx(default_metrics[key], rel=1e-4, abs=1e-6), key


def record_entropy_loss(args, log_probs, entropy, batch, reduce):
    """A custom loss (--loss-type custom_loss) that reads the reference pass's entropies."""
    ENTROPY_SEEN.append((batch.ref_entropy.shape, log_probs.shape))
    loss = reduce(-log_probs * batch.advantages)
    return loss, {"loss": loss.detach()}


def _reference_entropies(checkpoint, data, temperature: float) -> list[torch.Tensor]:
    """Per sample, the softmax entropy at each response token of a plain HF forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    result = []
    with torch.no_grad():
        for tokens, response_length in zip(data["tokens"], data["response_lengths"]):
            logits = model(torch.tensor([tokens])).logits[0, len(tokens) - response_length - 1:-1] / temperature
            result.append(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))
    return result


def test_rollout_entropy_and_the_debug_train_dump(tiny_checkpoint, tmp_path):
    """--use-rollout-entropy keeps the old-policy and reference passes' entropies (logged, dumped, given to a
    custom loss); --save-debug-train-data writes slime's payload with them."""
    data = make_train_data(4, vocab_size=300, seed=8, num_steps=2)
    data["sample_indices"] = [3, 1, 0, 2]
    trainer = make_trainer(make_args(tiny_checkpoint, "--use-rollout-entropy", "--use-kl-loss", "--ref-load",
                                     tiny_checkpoint, "--rollout-temperature", "0.8", "--save-debug-train-data",
                                     str(tmp_path / "train_{rollout_id}.pt")), with_ref=True)
    metrics = trainer.train(5, data)
    reference = _reference_entropies(tiny_checkpoint, data, 0.8)
    masks = [torch.tensor(mask, dtype=torch.float32) for mask in data["loss_masks"]]
    masked_mean = float(sum((e * m).sum() for e, m in zip(reference, masks)) / sum(m.sum() for m in masks))
    assert metrics["rollout/entropy"] == pytest.approx(masked_mean, rel=1e-4)
    assert metrics["rollout/ref_entropy"] == pytest.approx(masked_mean, rel=1e-4)  # the reference: same model

    payload = torch.load(tmp_path / "train_5.pt", weights_only=True)
    assert payload["format_version"] == 2 and payload["rollout_id"] == 5 and payload["rank"] == 0
    samples = payload["samples"]
    assert [s["sample_index"] for s in samples] == [0, 1, 2, 3]
    assert payload["dp_shards"][0]["sample_indices"] == [3, 1, 0, 2]
    by_index = dict(zip(data["sample_indices"], range(4)))
    for sample in samples:
        i = by_index[sample["sample_index"]]
        assert sample["tokens"] == data["tokens"][i] and sample["rewards"] == data["rewards"][i]
        assert sample["log_probs"].shape == sample["advantages"].shape == (data["response_lengths"][i],)
        torch.testing.assert_close(sample["entropy"], reference[i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sample["ref_entropy"], reference[i], rtol=1e-4, atol=1e-5)

    ENTROPY_SEEN.clear()
    custom = make_trainer(make_args(tiny_checkpoint, "--use-rollout-entropy", "--use-kl-loss", "--ref-load",
                                    tiny_checkpoint, "--loss-type", "custom_loss", "--custom-loss-function-path",
                                    f"{__name__}.record_entropy_loss"), with_ref=True)
    custom.train(0, make_train_data(2, vocab_size=300, seed=9))
    assert ENTROPY_SEEN and all(ref == log_probs for ref, log_probs in ENTROPY_SEEN)


def test_ref_ckpt_step_loads_that_checkpoint_of_the_ref_save_folder(tiny_checkpoint, tmp_path):
    save = tmp_path / "save"
    trained = make_trainer(make_args(tiny_checkpoint, "--lr", "1e-2", "--save", save))
    trained.train(0, make_train_data(4, vocab_size=300, seed=9))
    trained.save_model(0, run_state={"data_source": {}})
    trained.train(1, make_train_data(4, vocab_size=300, seed=10))
    trained.save_model(1, run_state={"data_source": {}})  # `latest` names rollout_1: the step picks rollout_0
    expected = make_trainer(make_args(save / "rollout_0", "--lr", "1e-2"))
    trainer = make_trainer(make_args(tiny_checkpoint, "--use-kl-loss", "--ref-load", save, "--ref-ckpt-step", "0"),
                           with_ref=True)
    trainer.snapshot.restore("ref")
    reference, loaded = full_params(expected), full_params(trainer)
    assert all(torch.equal(reference[name], loaded[name]) for name in reference)


def test_stateless_adam_step_is_a_fresh_adamw_step():
    from slime.backends.stateless_adam import StatelessAdam

    torch.manual_seed(0)
    initial = torch.randn(16, dtype=torch.float64)
    grads = [torch.randn_like(initial) for _ in range(4)]
    param = initial.clone()
    optimizer = StatelessAdam([param], lr=0.03, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
    expected = initial.clone()
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        reference = expected.clone().requires_grad_(True)
        reference.grad = grad.clone()
        torch.optim.AdamW([reference], lr=0.03, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1).step()
        expected = reference.detach()
    torch.testing.assert_close(param, expected)
    assert optimizer.state_dict()["state"] == {}
