"""GPU-only checks of the FSDP trainer (skipped without CUDA): bf16 mixed-precision training, offload/onload
releasing and restoring device memory, the critic, and FlashAttention varlen over packed micro-batches against
per-sample transformers forwards."""

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_train_offload_onload(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer

    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=3, hidden_size=256, intermediate_size=512)
    args = make_args(checkpoint, "--lr", "1e-3", "--micro-batch-size", "2", "--recompute-activations",
                     "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", checkpoint, device="cuda")
    trainer = make_trainer(args, with_ref=True)
    assert trainer.device.type == "cuda"
    data = make_train_data(8, vocab_size=300, seed=2, num_steps=2)
    first = trainer.train(0, data)
    assert first["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(first["train/loss"]))
    assert trainer.last_step_metrics[0]["train/ppo_kl"] == 0.0
    assert trainer.last_step_metrics[0]["train/kl_loss"] == 0.0
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    state_bytes = 3 * sum(t.numel() * t.element_size() for t in local)  # fp32 params + Adam's two moments
    param_ids = [id(p) for p in trainer.model.parameters()]
    on_device = torch.cuda.memory_allocated()
    # The actor's transient device copy (taken around the ref pass, weight_snapshot.py) is dropped, not restored.
    transient = sum(t.numel() * t.element_size() for t in trainer.snapshot.device_copies.get("actor", {}).values())
    snapshot_bytes = sum(t.numel() * t.element_size() for store in trainer.snapshot.device_copies.values()
                         for t in store.values())
    trainer.offload()
    released = [t for t in local + [v.to_local() if isinstance(v, DTensor) else v
                                    for s in trainer.backend._optimizer.state.values() for v in s.values()]
                if t.is_cuda]
    assert len(released) > len(local) and all(t.untyped_storage().nbytes() == 0 for t in released)
    # The parameter shards, Adam's moments and the weight sets' device copies all leave (measured on an H200:
    # 25.5 MB freed, 15.3 of state and 10.2 of copies); before the offload by storage, about one fp32 copy of the
    # shards stayed allocated, never explained.
    assert on_device - torch.cuda.memory_allocated() >= 0.99 * (state_bytes + snapshot_bytes)
    with pytest.raises(RuntimeError, match="offloaded: call onload"):  # its storages are empty: no reading them
        trainer.backend.hf_weights(None)
    with trainer.backend.resident():  # what a checkpoint of an offloaded model (the PPO critic's) goes through
        assert not trainer.backend.offloaded
        resident = {name: tensor.detach().cpu() for name, tensor in trainer.backend.hf_weights(None)}
    assert trainer.backend.offloaded and torch.cuda.memory_allocated() <= on_device - state_bytes
    trainer.onload()
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    assert [id(p) for p in trainer.model.parameters()] == param_ids  # the optimizer still holds these
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    onloaded = {name: tensor.detach().cpu() for name, tensor in trainer.backend.hf_weights(None)}
    assert resident.keys() == onloaded.keys() and all(torch.equal(t, onloaded[n]) for n, t in resident.items())
    assert torch.cuda.memory_allocated() >= on_device - transient - 0.05 * state_bytes
    second = trainer.train(1, data)
    assert second["train/kl_loss"] != 0.0
    assert any(not torch.equal(p.full_tensor(), before[n]) for n, p in trainer.model.named_parameters())


def test_gpu_ppo_critic_fits_returns_and_feeds_the_actor(tmp_path):
    from slime.utils.tiny_model import build_tiny_model
    from tests.backends.fsdp_utils.test_critic import make_critic
    from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer

    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=4)
    args = make_args(checkpoint, "--advantage-estimator", "ppo", "--lr", "1e-3", "--critic-lr", "2e-3",
                     "--micro-batch-size", "2", device="cuda")
    data = make_train_data(8, vocab_size=300, seed=5)
    critic = make_critic(args)
    assert critic.device.type == "cuda"
    values = critic.compute_values(0, data)
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in values)
    returns = [torch.full((n,), 0.5) for n in data["response_lengths"]]
    losses = [critic.train(i, data, critic.compute_values(i, data), returns)["critic/value_loss"] for i in range(8)]
    assert losses[-1] < 0.5 * losses[0]  # bf16 forward, fp32 master weights: the values move to the targets
    dist.destroy_process_group()
    actor = make_trainer(args)
    metrics = actor.train(0, data, values)
    assert torch.isfinite(torch.tensor(metrics["train/pg_loss"])) and metrics["train/grad_norm"] > 0
    assert len(actor.last_returns) == 8


def test_gpu_varlen_packed_log_probs_match_per_sample_forward(tmp_path):
    """Packed varlen log-probs (and their gradients) equal per-sample transformers forwards and the sdpa packed
    path, in bf16, with grouped-query attention and samples of unequal lengths."""
    from transformers import AutoModelForCausalLM

    from slime.backends.attention import VARLEN, varlen_supported
    from slime.backends.fsdp_utils.model import PolicyModel, attention_implementation
    from slime.backends.packing import pack_samples
    from slime.utils.tiny_model import build_tiny_model

    device = torch.device("cuda")
    assert varlen_supported(device) and attention_implementation() == VARLEN
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=5, hidden_size=256, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    generator = torch.Generator().manual_seed(0)
    lengths, response_lengths = [37, 200, 5, 129], [20, 150, 2, 100]
    tokens = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]
    batch = pack_samples(tokens, response_lengths, [0, 1, 2, 3]).to(device)

    def packed(implementation):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16,
                                                  attn_implementation=implementation).to(device)
        model = PolicyModel(hf)
        log_probs, _ = model.forward_micro_batch(batch)
        log_probs.sum().backward()
        return log_probs.detach().float(), hf.model.layers[0].self_attn.q_proj.weight.grad.float()

    varlen_log_probs, varlen_grad = packed(VARLEN)
    sdpa_log_probs, sdpa_grad = packed("sdpa")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
    expected = []
    with torch.no_grad():
        for sample, response_length in zip(tokens, response_lengths):
            logits = reference(torch.tensor([sample], device=device)).logits[0].float()
            log_softmax = torch.log_softmax(logits[-response_length - 1:-1], -1)
            expected.append(log_softmax.gather(1, torch.tensor(sample[-response_length:], device=device)[:, None])[:, 0])
    expected = torch.cat(expected)
    assert varlen_log_probs.shape == expected.shape
    assert (varlen_log_probs - expected).abs().max() < 0.05  # bf16 forward; values are ~ -5.7
    assert (varlen_log_probs - sdpa_log_probs).abs().max() < 0.05
    relative = (varlen_grad - sdpa_grad).norm() / sdpa_grad.norm()
    assert relative < 0.02, relative


def test_micro_batch_upload_does_not_wait_for_the_gpu():
    """A micro-batch's tensors reach the device without the host waiting for queued GPU work (a pageable
    `.to("cuda")` would block until a second of GPU sleep had run), and arrive intact."""
    from slime.backends.packing import pack_samples

    micro_batch = pack_samples([list(range(3, 40)), list(range(5, 20))], [10, 4], [0, 1])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    on_device = micro_batch.to("cuda")
    assert not torch.cuda.current_stream().query(), "the upload waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(on_device.input_ids.cpu(), micro_batch.input_ids)
    assert torch.equal(on_device.cu_seqlens.cpu(), micro_batch.cu_seqlens)
    assert torch.equal(on_device.target_ids.cpu(), micro_batch.target_ids)
