"""LoRA on the Megatron backend (2 gloo processes at TP=2, and TP=1): the adapter gradients of one step equal a
float64 reference on the merged weights W + s * B @ A (a fused layer's shared A gets the sum of its HF layers'
gradients), only the adapters change, the reference pass (adapters disabled) is the base model, and the PEFT folder
a checkpoint writes loads in PEFT with the trainer's log-probs."""

from __future__ import annotations

import pytest
import torch

from slime.backends.lora_adapter import is_lora_name
from slime.backends.packing import pack_samples
from tests.helpers.fsdp_helpers import make_train_data, run_distributed
from tests.helpers.lora_helpers import (
    LORA_FLAGS,
    SCALE,
    reference_log_probs,
    sample_mean_sft_loss,
    wide_tiny_checkpoint,
)
from tests.helpers.megatron_helpers import make_megatron_args

pytest.importorskip("megatron.core")

FUSED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # share the first one's A


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return wide_tiny_checkpoint(tmp_path_factory.mktemp("lora_megatron"))


def _shared_a_adapter(hf_config, rank: int = 4, seed: int = 7) -> dict[str, torch.Tensor]:
    """A random adapter that the fused layers can hold: k, v share q's lora_A and up shares gate's."""
    generator = torch.Generator().manual_seed(seed)
    hidden, ffn = hf_config.hidden_size, hf_config.intermediate_size
    heads, kv_heads, head_dim = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.head_dim
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}
    adapter = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (out_features, in_features) in shapes.items():
            prefix = f"model.layers.{layer}.{module}"
            leaf = module.rsplit(".", 1)[1]
            if leaf in FUSED:
                shared = prefix.replace(leaf, FUSED[leaf])
                adapter[f"{prefix}.lora_A.weight"] = adapter[f"{shared}.lora_A.weight"]
            else:
                adapter[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
            adapter[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
    return adapter


def _train_one_step(rank, world_size, port, checkpoint, save, data):
    from slime.backends.megatron_utils.lora import adapter_to_hf, load_adapter_from_hf
    from slime.backends.megatron_utils.parallel import destroy_model_parallel
    from tests.helpers.fsdp_helpers import make_trainer

    args = make_megatron_args(checkpoint, *LORA_FLAGS, "--loss-type", "sft_loss", "--clip-grad", "0", "--lr", "1e-2",
                              "--micro-batch-size", "2", "--use-kl-loss", "--kl-loss-coef", "0", "--save", save,
                              "--save-hf", f"{save}_hf", world_size=world_size, tp=world_size)
    trainer = make_trainer(args, rank, world_size, port, with_ref=True)
    backend = trainer.backend
    adapter = _shared_a_adapter(backend.hf_config)
    unshared = {**adapter, "model.layers.1.self_attn.k_proj.lora_A.weight":
                adapter["model.layers.1.self_attn.k_proj.lora_A.weight"] + 0.01}
    with pytest.raises(ValueError, match="q_proj, .*k_proj, .*v_proj have different lora_A"):
        load_adapter_from_hf(backend.model_chunks, backend.hf_config, unshared, "peft-folder")
    load_adapter_from_hf(backend.model_chunks, backend.hf_config, adapter, "test")
    assert backend.adapter_weights().keys() == adapter.keys()
    trainable = {name for chunk in backend.model_chunks for name, p in chunk.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_name(name) for name in trainable)
    base_before = {name: p.detach().clone() for chunk in backend.model_chunks for name, p in chunk.named_parameters()
                   if not is_lora_name(name)}
    grads = []
    backend.optimizer.optimizer.register_step_pre_hook(lambda *_: grads.append(
        adapter_to_hf(backend.model_chunks, backend.hf_config, local_of=lambda param: param.main_grad)))
    metrics = trainer.train(0, data)
    for chunk in backend.model_chunks:
        for name, p in chunk.named_parameters():
            if not is_lora_name(name):
                assert torch.equal(p, base_before[name]), name
    packed = pack_samples(data["tokens"], data["response_lengths"], list(range(len(data["tokens"]))))
    ref = trainer._log_probs_with("ref", [[packed]], len(data["tokens"]))
    trained = list(torch.split(backend.forward_only([packed])[0][0], data["response_lengths"]))
    trainer.save_model(0, run_state={"data_source": {}})
    destroy_model_parallel()
    return adapter, metrics, grads[0], ref, trained


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP=2: ~80 s on 2 cores
def test_adapter_gradients_equal_the_merged_weight_reference(checkpoint, tmp_path, tp):
    from transformers import AutoModelForCausalLM

    data = make_train_data(4, vocab_size=300, seed=3)
    save = tmp_path / "save"
    adapter, metrics, grads, ref, trained = run_distributed(_train_one_step, tp, checkpoint, save, data)[0]

    log_probs, leaves = reference_log_probs(checkpoint, {k: v.clone() for k, v in adapter.items()}, SCALE,
                                            data["tokens"], data["response_lengths"])
    loss = sample_mean_sft_loss(log_probs, data["loss_masks"])
    loss.backward()
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-5)
    # each fused layer's shared A counts once (the adapter's q/k/v and gate/up entries are one tensor)
    unique = {id(tensor): tensor for tensor in adapter.values()}
    assert metrics["lora/trainable_params"] == sum(tensor.numel() for tensor in unique.values())
    assert grads.keys() == leaves.keys()
    for name, grad in grads.items():
        expected = leaves[name].grad
        leaf = name.split(".")[-3]
        if name.endswith("lora_A.weight") and (leaf in FUSED or leaf in FUSED.values()):
            group = FUSED.get(leaf, leaf)
            expected = sum(leaves[name.replace(leaf, other)].grad
                           for other in (group, *[k for k, v in FUSED.items() if v == group]))
        torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-6, msg=name)

    base, _ = reference_log_probs(checkpoint, {}, SCALE, data["tokens"], data["response_lengths"])
    for r, b in zip(ref, base):
        torch.testing.assert_close(r.double(), b.detach(), rtol=1e-5, atol=1e-5)

    peft = pytest.importorskip("peft")
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                                           str(save / "iter_0000000" / "adapter")).eval()
    with torch.no_grad():
        for sample, response_length, expected in zip(data["tokens"], data["response_lengths"], trained):
            ids = torch.tensor([sample])
            log_probs = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(log_probs[-response_length:], expected, rtol=1e-5, atol=1e-5)

    # --save-hf: the merged model, W + s * B @ A with the saved adapter
    from safetensors.torch import load_file

    merged = load_file(str(tmp_path / "save_hf" / "model.safetensors"))
    base_weights = load_file(str(checkpoint / "model.safetensors"))
    trained_adapter = load_file(str(save / "iter_0000000" / "adapter" / "adapter_model.safetensors"))
    assert merged.keys() == base_weights.keys()
    for name, value in merged.items():
        layer = "base_model.model." + name.removesuffix(".weight")
        expected = base_weights[name]
        if layer + ".lora_A.weight" in trained_adapter:
            expected = expected + SCALE * trained_adapter[layer + ".lora_B.weight"] @ trained_adapter[
                layer + ".lora_A.weight"]
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)


def _train_save_train(rank, world_size, port, checkpoint, save, data, resume: bool):
    from slime.backends.megatron_utils.lora import load_adapter_from_hf
    from slime.backends.megatron_utils.parallel import destroy_model_parallel
    from tests.helpers.fsdp_helpers import make_trainer

    extra = ("--load", save) if resume else ()
    args = make_megatron_args(checkpoint, *LORA_FLAGS, "--lr", "1e-2", "--lr-warmup-iters", "2",
                              "--micro-batch-size", "2", "--save", save, *extra, world_size=world_size, tp=world_size)
    trainer = make_trainer(args, rank, world_size, port)
    backend = trainer.backend
    if not resume:
        load_adapter_from_hf(backend.model_chunks, backend.hf_config, _shared_a_adapter(backend.hf_config), "test")
        trainer.train(0, data[0])
        trainer.save_model(0, run_state={"data_source": {}})
    start = trainer.start_rollout_id
    metrics = trainer.train(1, data[1])
    adapter = backend.adapter_weights()
    destroy_model_parallel()
    return start, metrics, adapter


@pytest.mark.slow  # two Megatron trainers in turn at TP=2 (~2 min on 2 cores)
def test_resume_at_tp2_restores_adapter_and_optimizer_exactly(checkpoint, tmp_path):
    save = tmp_path / "save"
    data = [make_train_data(8, vocab_size=300, seed=s, num_steps=2) for s in (11, 12)]
    _, uninterrupted, expected = run_distributed(_train_save_train, 2, checkpoint, save, data, False)[0]
    start, metrics, adapter = run_distributed(_train_save_train, 2, checkpoint, save, data, True)[0]
    assert start == 1
    assert metrics["train/loss"] == pytest.approx(uninterrupted["train/loss"], rel=1e-6)
    assert metrics["train/grad_norm"] == pytest.approx(uninterrupted["train/grad_norm"], rel=1e-6)
    for name, value in adapter.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
