"""The FSDP trainer on GLM-4 / GLM-4.5 (transformers' models) and routing replay for the biased, group-limited sigmoid
router (GLM-4.5; DeepSeek-V3 has the same router class shape).

- Re-bound routers route freely exactly as transformers' (logits equal) for GLM-4.5 with group limits and a tiny
  DeepSeek-V3 (MLA attention, 4 groups / 2 kept), and obey forced ids with weights from the unbiased scores;
  replaying a DeepSeek-V3 "engine's" ids on a near-tie makes the trainer's logits equal the engine's.
- The trainer's old-policy log-probs equal transformers' for GLM-4 and GLM-4.5 (fp32, < 1e-5).
- R3 on a constructed near-tie: experts 1 and 2 (in different groups) share their router rows and their correction
  biases differ by +-2d, with the sign flipped between the engine's checkpoint and the trainer's. Routing freely the
  trainer picks the other expert (and the other group) wherever the pair straddles the boundary; replaying the
  engine's routed experts (SGLang layout, leading dense layer included) it reproduces the engine's experts exactly
  and its log-probs match the rollout's to < 1e-4.
"""

import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from slime.backends.fsdp_utils.moe_router import install_routers
from slime.backends.routing_replay import ReplayStage
from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer

GROUPS = dict(n_group=4, topk_group=2, num_experts_per_tok=2)


def _free_logits_equal_transformers(model, tokens):
    with torch.no_grad():
        expected = model(tokens).logits
    replay, trace = install_routers(model, None)
    assert replay.stage is ReplayStage.FALLTHROUGH
    trace.start()
    with torch.no_grad():
        got = model(tokens).logits
    assert expected.std() > 0.5 and torch.equal(got, expected)
    # the router-loss trace: logits, the sigmoid scores normalised over the experts (Megatron's "probs" for a
    # sigmoid router's load-balancing loss), the ids used
    for logits, probs, ids in trace.stop():
        torch.testing.assert_close(probs, torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True))
        assert ids.shape == (tokens.numel(), model.config.num_experts_per_tok)
    return replay


def test_rebound_router_routes_like_transformers_glm4_moe(tmp_path):
    path = build_tiny_model(tmp_path, arch="glm4_moe", initializer_range=0.3, **GROUPS)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = torch.tensor([[(7 * i + 3) % 300 for i in range(24)]])
    replay = _free_logits_equal_transformers(model, tokens)
    assert replay.layer_indices == (1, 2) and replay.num_hidden_layers == 3
    # forced ids: the weights are the unbiased sigmoid scores at those ids, renormalised, times the scaling
    gate = model.model.layers[1].mlp.gate
    hidden = torch.randn(5, 64)
    forced = torch.tensor([[0, 7], [1, 2], [3, 4], [5, 6], [2, 0]])
    replay.stage = ReplayStage.REPLAY_FORWARD
    with replay.micro_batch(torch.stack([forced, forced], dim=1)):
        _, weights, ids = gate(hidden)
    assert torch.equal(ids, forced)
    scores = torch.sigmoid(hidden @ gate.weight.T).gather(1, forced)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) * 2.5)


def _tiny_deepseek_v3(bias_sign: float) -> DeepseekV3ForCausalLM:
    """MLA, 4 groups / 2 kept, a leading dense layer; experts 1 and 2 (groups 0 and 1) share their router row and
    their correction biases differ by 2 * bias_sign * d."""
    config = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                              first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.3)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            gate = layer.mlp.gate
            gate.weight.normal_(std=0.5)
            gate.weight[2] = gate.weight[1]
            gate.e_score_correction_bias.normal_(std=0.1)
            gate.e_score_correction_bias[1:3] = torch.tensor([0.3 + bias_sign * 1e-5, 0.3 - bias_sign * 1e-5])
    return model


def test_rebound_router_routes_like_transformers_deepseek_v3():
    replay = _free_logits_equal_transformers(_tiny_deepseek_v3(1.0),
                                             torch.tensor([[(5 * i + 1) % 256 for i in range(20)]]))
    assert replay.layer_indices == (1, 2)


def test_replay_makes_a_deepseek_v3_trainer_compute_the_engines_function():
    """transformers' model with +d stands in for the engine; the trainer's copy has -d. Replaying the engine's ids
    (recorded on its biased, group-masked scores) the trainer's logits equal the engine's; routing freely they do
    not (the near-tie flips experts 1 and 2 wherever they straddle the top-k boundary)."""
    engine, trainer = _tiny_deepseek_v3(1.0), _tiny_deepseek_v3(-1.0)
    tokens = torch.tensor([[(7 * i + 3) % 256 for i in range(48)]])
    picks = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, output: picks.append(output[2]))
             for layer in engine.model.layers[1:]]
    with torch.no_grad():
        expected = engine(tokens).logits
    for hook in hooks:
        hook.remove()
    replay, _ = install_routers(trainer, None)
    with torch.no_grad():
        free = trainer(tokens).logits
    replay.stage = ReplayStage.REPLAY_FORWARD
    with replay.micro_batch(torch.stack(picks, dim=1)), torch.no_grad():
        replayed = trainer(tokens).logits
    agreement = replay.take_agreement()
    assert (free - expected).abs().max() > 1e-3
    torch.testing.assert_close(replayed, expected, rtol=0, atol=1e-5)
    assert 0 < agreement[:, 0].sum() < agreement[:, 1].sum()  # the trainer's own choice differs on some tokens


@pytest.mark.parametrize("arch", ["glm4", "glm4_moe"])
def test_trainer_log_probs_equal_transformers(tmp_path, arch):
    path = build_tiny_model(tmp_path, arch=arch, initializer_range=0.3, **(GROUPS if arch == "glm4_moe" else {}))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    samples = [[(7 * i + 3 * j + 1) % 300 for j in range(9 + 3 * i)] for i in range(4)]
    data = {"tokens": samples, "response_lengths": [5] * 4, "loss_masks": [[1] * 5] * 4, "rewards": [0.0, 1.0] * 2,
            "raw_reward": [0.0, 1.0] * 2, "group_indices": [0, 0, 1, 1], "sample_indices": list(range(4)),
            "truncated": [0] * 4, "rollout_log_probs": [[0.0] * 5] * 4, "rollout_id": 0, "num_steps_per_rollout": 1,
            "global_batch_size": 4}
    trainer = make_trainer(make_args(path, "--micro-batch-size", "2", "--get-mismatch-metrics"))
    _, per_sample, _ = trainer._prepare(data)
    dist.destroy_process_group()
    for tokens, old in zip(samples, per_sample["old_log_probs"]):
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, :-1], dim=-1)
        expected = log_probs.gather(1, torch.tensor(tokens[1:])[:, None])[-5:, 0]
        torch.testing.assert_close(old, expected, rtol=0, atol=1e-5)


def _with_bias_tie(source, target, sign: float):
    """A copy of `source` whose experts 1 and 2 (groups 0 and 1) have the same router row and correction biases
    b + sign*d and b - sign*d: their choice scores differ by exactly 2*sign*d on every token."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    for name, weight in weights.items():
        if name.endswith("mlp.gate.weight"):
            weight[2] = weight[1]
        if name.endswith("mlp.gate.e_score_correction_bias"):
            weight[1], weight[2] = 0.3 + sign * 1e-5, 0.3 - sign * 1e-5
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_r3")
    base = build_tiny_model(root / "base", arch="glm4_moe", seed=5, initializer_range=0.3, **GROUPS)
    return _with_bias_tie(base, root / "engine", 1.0), _with_bias_tie(base, root / "trainer", -1.0)


def _rollout(checkpoint) -> dict:
    engine = Engine(str(checkpoint), device="cpu", num_kvcache_blocks=64, enable_return_routed_experts=True)
    data = {key: [] for key in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "group_indices",
                                "sample_indices", "truncated", "rollout_log_probs", "rollout_routed_experts")}
    for i in range(4):
        prompt = [(5 * i + 3 * j + 1) % 300 for j in range(6 + i)]
        rid = engine.add_request(prompt, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True,
                                          "sampling_seed": i}, return_routed_experts=True)
        output = None
        while output is None:
            output = next((o for o in engine.step() if o.rid == rid and o.finished), None)
        for key, value in (("tokens", prompt + output.output_token_ids),
                           ("response_lengths", len(output.output_token_ids)),
                           ("loss_masks", [1] * len(output.output_token_ids)), ("rewards", float(i % 2)),
                           ("raw_reward", float(i % 2)), ("group_indices", i // 2), ("sample_indices", i),
                           ("truncated", 0), ("rollout_log_probs", output.output_log_probs),
                           ("rollout_routed_experts", output.routed_experts)):
            data[key].append(value)
    data.update(rollout_id=0, num_steps_per_rollout=1, global_batch_size=4)
    return data


def test_r3_reproduces_the_engines_grouped_routing_on_a_near_tie(tied):
    engine_checkpoint, trainer_checkpoint = tied
    rollout = _rollout(engine_checkpoint)
    assert all(r.shape[1:] == (3, 2) and not r[:, 0].any() for r in rollout["rollout_routed_experts"])
    runs = {}
    for flags in ((), ("--use-rollout-routing-replay",)):
        trainer = make_trainer(make_args(trainer_checkpoint, "--get-mismatch-metrics", "--micro-batch-size", "4",
                                         *flags))
        received = []
        for layer in trainer.model.hf_model.get_decoder().layers[1:]:
            layer.mlp.experts.register_forward_pre_hook(
                lambda _m, inputs, into=received: into.append(inputs[1].clone()))
        _, per_sample, metrics = trainer._prepare(rollout)
        dist.destroy_process_group()
        mismatch = max(float((old - torch.tensor(r)).abs().max())
                       for old, r in zip(per_sample["old_log_probs"], rollout["rollout_log_probs"]))
        runs[bool(flags)] = mismatch, metrics, received
    free_mismatch, _, _ = runs[False]
    mismatch, metrics, received = runs[True]
    engine_rows = np.concatenate(rollout["rollout_routed_experts"])
    last_rows = np.cumsum([len(t) for t in rollout["tokens"]]) - 1  # a sample's last token routes freely
    assert len(received) == 2  # one micro-batch through the two MoE layers
    print(f"R3 mismatch {mismatch:.2e}, free {free_mismatch:.2e}, agreement {metrics['train/router_agreement']:.3f}")
    for layer, ids in zip((1, 2), received):
        np.testing.assert_array_equal(np.sort(np.delete(ids.numpy(), last_rows, axis=0), -1),
                                      np.sort(engine_rows[:, layer], -1))
    assert metrics["train/router_agreement"] < 0.95  # the trainer's own choice flips on the near-ties
    assert mismatch < 1e-4
    assert free_mismatch > 1e-2


def test_glm4_moe_trains_with_router_losses(tmp_path):
    path = build_tiny_model(tmp_path, arch="glm4_moe", initializer_range=0.3, **GROUPS)
    trainer = make_trainer(make_args(path, "--micro-batch-size", "4", "--lr", "1e-2", "--moe-aux-loss-coeff", "0.01",
                                     "--moe-z-loss-coeff", "0.001"))
    before = {name: param.full_tensor().clone() for name, param in trainer.model.named_parameters()}
    metrics = trainer.train(0, make_train_data(8, vocab_size=300, seed=1))
    after = dict(trainer.model.named_parameters())
    dist.destroy_process_group()
    assert metrics["train/moe_aux_loss"] > 0 and metrics["train/moe_z_loss"] > 0
    assert metrics["train/moe_load_imbalance"] >= 1.0
    gate = "hf_model.model.layers.1.mlp.gate.weight"
    assert not torch.equal(after[gate].full_tensor(), before[gate])  # the router learns through the weights
