"""The train flow over the FSDP backend in one process: loss and gradient independent of the micro-batch split, checkpoint round-trip and
exact resume, GRPO raising the log-prob of a rewarded response."""

import json

import pytest
import torch
import torch.distributed as dist

from slime.backends.fsdp_utils.checkpoint import checkpoint_dir
from slime.backends.packing import pack_samples
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import capture_grads, full_params, make_args, make_train_data, make_trainer


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", seed=2)


def _one_step(checkpoint, data, *extra, lr="1e-3"):
    args = make_args(checkpoint, "--lr", lr, *extra)
    trainer = make_trainer(args, with_ref=args.use_kl_loss)
    grads = capture_grads(trainer)
    metrics = trainer.train(0, data)
    dist.destroy_process_group()
    return metrics, grads


SPLITS = [
    ("--micro-batch-size", "1"),
    ("--micro-batch-size", "3"),
    ("--micro-batch-size", "8"),
    ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "20"),
]


@pytest.mark.parametrize("mode", [(), ("--calculate-per-token-loss",), ("--advantage-estimator", "gspo")])
def test_loss_and_grad_independent_of_micro_batch_split(tiny_checkpoint, mode):
    data = make_train_data(8, vocab_size=300, seed=3, num_steps=2, with_rollout_log_probs=True)
    algorithm = ("--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--ref-load", tiny_checkpoint,
                 "--entropy-coef", "0.01", "--use-tis", *mode)
    # A tiny lr: Adam's first update is ~lr * sign(grad), which turns rounding noise in near-zero gradients into
    # parameter differences of size lr before the second step.
    results = [_one_step(tiny_checkpoint, data, *algorithm, *split, lr="1e-7") for split in SPLITS]
    reference_metrics, reference_grads = results[0]
    assert len(reference_grads) == 2
    for metrics, grads in results[1:]:
        for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/entropy_loss", "train/grad_norm",
                    "train/ppo_kl", "train/train_rollout_logprob_abs_diff"):
            assert metrics[key] == pytest.approx(reference_metrics[key], rel=1e-5, abs=1e-6), key
        for step_grads, step_reference in zip(grads, reference_grads):
            for name, grad in step_grads.items():
                torch.testing.assert_close(grad, step_reference[name], rtol=1e-4, atol=1e-6)


def test_loss_matches_hand_computed_sample_mean(tiny_checkpoint):
    """SFT loss = mean over samples of the per-sample masked token mean of -log p (slime's default reducer)."""
    data = make_train_data(4, vocab_size=300, seed=5)
    metrics, _ = _one_step(tiny_checkpoint, data, "--loss-type", "sft_loss", "--micro-batch-size", "3")
    args = make_args(tiny_checkpoint)
    trainer = make_trainer(args)
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(4)))
    with torch.no_grad():
        log_probs, _ = trainer.model.forward_micro_batch(packed)
    per_sample = []
    for lp, mask in zip(torch.split(log_probs, data["response_lengths"]), data["loss_masks"]):
        mask = torch.tensor(mask, dtype=torch.float32)
        per_sample.append(-(lp * mask).sum() / max(mask.sum(), 1))
    assert metrics["train/loss"] == pytest.approx(float(torch.stack(per_sample).mean()), rel=1e-5)


def test_fan_out_loss_is_the_mean_over_rollouts_of_their_token_means(tiny_checkpoint):
    """Samples 1 and 2 are siblings of one rollout (a fan-out): the SFT loss averages over 3 rollouts, the
    siblings' tokens pooled into one mean, for any micro-batch split."""
    data = make_train_data(4, vocab_size=300, seed=5)
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    siblings = float(masks[1].sum() + masks[2].sum())
    data["rollout_mask_sums"] = [float(masks[0].sum()), siblings, siblings, float(masks[3].sum())]
    data["rollout_num_samples"] = [1, 2, 2, 1]
    results = [_one_step(tiny_checkpoint, data, "--loss-type", "sft_loss", "--micro-batch-size", mbs)[0]
               for mbs in ("1", "3")]
    trainer = make_trainer(make_args(tiny_checkpoint))
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(4)))
    with torch.no_grad():
        log_probs, _ = trainer.model.forward_micro_batch(packed)
    nll = [-(lp * m).sum() for lp, m in zip(torch.split(log_probs, data["response_lengths"]), masks)]
    expected = (nll[0] / masks[0].sum() + (nll[1] + nll[2]) / siblings + nll[3] / masks[3].sum()) / 3
    for metrics in results:
        assert metrics["train/loss"] == pytest.approx(float(expected), rel=1e-5)


def test_first_step_has_zero_ppo_kl_and_kl_with_ref_equal_to_actor(tiny_checkpoint):
    data = make_train_data(4, vocab_size=300, seed=7, num_steps=2)
    metrics, _ = _one_step(tiny_checkpoint, data, "--use-kl-loss", "--kl-loss-coef", "0.5",
                           "--ref-load", tiny_checkpoint, "--micro-batch-size", "1")
    # train() averages both steps; the first step is exactly on-policy: check with a single step too.
    single, _ = _one_step(tiny_checkpoint, make_train_data(4, vocab_size=300, seed=7, num_steps=1),
                          "--use-kl-loss", "--kl-loss-coef", "0.5", "--ref-load", tiny_checkpoint,
                          "--num-steps-per-rollout", "1", "--micro-batch-size", "2")
    assert single["train/ppo_kl"] == 0.0
    assert single["train/kl_loss"] == 0.0
    assert metrics["train/kl_loss"] != 0.0  # the second step moved away from the reference


def test_checkpoint_loads_in_transformers_and_resume_is_exact(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    save = tmp_path / "ckpt"
    extra = ("--lr", "1e-3", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--save", save,
             "--micro-batch-size", "2")
    data = [make_train_data(8, vocab_size=300, seed=s, num_steps=2) for s in (11, 12)]

    trainer = make_trainer(make_args(tiny_checkpoint, *extra))
    trainer.train(0, data[0])
    trainer.save_model(0, run_state={"data_source": {}})  # a resumable checkpoint holds the driver's run state
    saved_params = full_params(trainer)
    uninterrupted = trainer.train(1, data[1])
    expected = full_params(trainer)
    dist.destroy_process_group()

    folder = checkpoint_dir(save, 0)
    assert (save / "latest").read_text().strip() == folder.name
    assert json.loads((folder / "meta.json").read_text())["rollout_id"] == 0
    assert not list(save.glob("*.tmp"))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_state = hf_model.state_dict()
    for name, value in saved_params.items():
        torch.testing.assert_close(hf_state[name.removeprefix("hf_model.")], value, rtol=0, atol=0)

    resumed = make_trainer(make_args(tiny_checkpoint, *extra, "--load", save))
    assert resumed.start_rollout_id == 1
    metrics = resumed.train(1, data[1])
    assert metrics["train/lr"] == uninterrupted["train/lr"]
    assert metrics["train/loss"] == uninterrupted["train/loss"]
    for name, value in full_params(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_grpo_steps_raise_log_prob_of_rewarded_response(tiny_checkpoint):
    data = make_train_data(4, vocab_size=300, seed=13)
    prompt = data["tokens"][0][:4]
    responses = [[17, 18, 19], [20, 21, 22], [23, 24, 25], [26, 27, 28]]
    data["tokens"] = [prompt + r for r in responses]
    data["response_lengths"] = [3] * 4
    data["loss_masks"] = [[1, 1, 1]] * 4
    data["rewards"] = [1.5, -0.5, -0.5, -0.5]  # group-normalised: response 0 is the rewarded one
    args = make_args(tiny_checkpoint, "--lr", "1e-3", "--micro-batch-size", "2")
    trainer = make_trainer(args)
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(4)))

    def sequence_log_probs():
        with torch.no_grad():
            log_probs, _ = trainer.model.forward_micro_batch(packed)
        return torch.stack([lp.sum() for lp in torch.split(log_probs, 3)])

    before = sequence_log_probs()
    for rollout_id in range(4):
        trainer.train(rollout_id, data)
    after = sequence_log_probs()
    assert after[0] > before[0] + 0.1
    assert (after[1:] < before[1:]).all()


def test_activation_recompute_gives_the_same_step(tiny_checkpoint):
    data = make_train_data(6, vocab_size=300, seed=17)
    plain, plain_grads = _one_step(tiny_checkpoint, data, "--micro-batch-size", "3")
    recomputed, recomputed_grads = _one_step(tiny_checkpoint, data, "--micro-batch-size", "3",
                                             "--recompute-activations")
    assert recomputed["train/loss"] == plain["train/loss"]
    for name, grad in recomputed_grads[0].items():
        torch.testing.assert_close(grad, plain_grads[0][name], rtol=1e-6, atol=1e-8)


def test_compiled_layers_give_the_same_step(tiny_checkpoint):
    """--compile-model (torch.compile of each decoder layer, dynamic shapes): the same loss and gradients, over
    micro-batches of different packed lengths (no recompile per length needed for correctness)."""
    data = make_train_data(6, vocab_size=300, seed=19)
    plain, plain_grads = _one_step(tiny_checkpoint, data, "--micro-batch-size", "2")
    compiled, compiled_grads = _one_step(tiny_checkpoint, data, "--micro-batch-size", "2", "--compile-model")
    assert compiled["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-5)
    for name, grad in compiled_grads[0].items():
        torch.testing.assert_close(grad, plain_grads[0][name], rtol=1e-4, atol=1e-6)


def test_keeping_gathered_parameters_gives_the_same_steps(tiny_checkpoint):
    """--no-reshard-after-forward: the same losses and gradients over two optimizer steps, with no-grad log-prob
    passes of the actor and of the swapped-in reference in between (a stale gathered copy of the parameters would
    show in the second step)."""
    data = make_train_data(8, vocab_size=300, seed=23, num_steps=2)
    algorithm = ("--micro-batch-size", "2", "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", tiny_checkpoint)
    plain, plain_grads = _one_step(tiny_checkpoint, data, *algorithm)
    kept, kept_grads = _one_step(tiny_checkpoint, data, *algorithm, "--no-reshard-after-forward")
    for key in ("train/loss", "train/kl_loss", "train/grad_norm", "train/ppo_kl"):
        assert kept[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-9), key
    assert len(kept_grads) == 2
    for step_grads, step_reference in zip(kept_grads, plain_grads):
        for name, grad in step_grads.items():
            torch.testing.assert_close(grad, step_reference[name], rtol=1e-6, atol=1e-8)
