"""Group-limited routing on the Megatron backend (DeepSeek-V3's router: sigmoid + expert-score correction bias to
choose, the best `topk_group` of `n_group` groups by their top-2 sum, weights from the unbiased sigmoid).

- grouped_routing.py picks transformers' experts where megatron-core's own rule (a group's top topk // topk_group)
  does not;
- routing replay (R3) on a tiny DeepSeek-V3 (4 groups, 2 kept) with a perturbed-bias batch: the trainer serves
  checkpoint B, the "engine" (transformers) checkpoint A, equal but for the correction biases, which move tokens
  across experts and groups. Replaying A's routing the trainer hands A's experts to the dispatcher and computes A's
  logits exactly (the bias only chooses; the weights come from the same router logits); routing freely (fallthrough,
  record) it computes B's, with B's group limits, and the router agreement counts the moved tokens."""

from __future__ import annotations

import pytest
import torch

from slime.utils.misc import find_free_port
from tests.helpers.megatron_families import build_family_checkpoint
from tests.helpers.megatron_helpers import build_megatron, make_megatron_args

pytest.importorskip("megatron.core")

LENGTHS = (9, 14, 6)


def _hf_router(num_experts, num_groups, group_topk, top_k, seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=num_experts, n_group=num_groups,
                              topk_group=group_topk, num_experts_per_tok=top_k, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(num_experts, generator=generator))
    return router, torch.randn(2000, 32, generator=generator)


@pytest.mark.parametrize("num_experts, num_groups, group_topk, top_k", [(8, 4, 2, 2), (256, 8, 4, 8), (64, 8, 3, 6)])
def test_group_rule_equals_transformers(num_experts, num_groups, group_topk, top_k):
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    from slime.backends.megatron_utils.grouped_routing import GroupLimitedTopK

    router, hidden = _hf_router(num_experts, num_groups, group_topk, top_k, seed=num_experts)
    with torch.no_grad():
        logits, weights, hf_ids = router(hidden)
        choice = logits.sigmoid() + router.e_score_correction_bias
        _, ids = GroupLimitedTopK().get_replay_topk(choice, top_k, num_groups, group_topk, None)
        _, megatron_ids = group_limited_topk(choice, top_k, len(hidden), num_experts, num_groups, group_topk)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    megatron_differs = (megatron_ids.sort(-1).values != hf_ids.sort(-1).values).any(-1).float().mean()
    if top_k // group_topk == 2:  # DeepSeek-V3 / R1: megatron-core's rule is transformers'
        assert megatron_differs == 0
    else:
        assert megatron_differs > 0.01


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(A, B): one tiny DeepSeek-V3, B with its correction biases perturbed."""
    from safetensors.torch import load_file, save_file

    engine = build_family_checkpoint(tmp_path_factory.mktemp("dsv3_engine"), "deepseek_v3")
    trainer = build_family_checkpoint(tmp_path_factory.mktemp("dsv3_trainer"), "deepseek_v3")
    weights = load_file(str(trainer / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    for name in [name for name in weights if name.endswith("e_score_correction_bias")]:
        weights[name] = weights[name] + 0.15 * torch.randn(weights[name].shape, generator=generator)
    save_file(weights, str(trainer / "model.safetensors"), metadata={"format": "pt"})
    return engine, trainer


def _hf_logits_and_routing(checkpoint, tokens):
    """transformers' logits of each sample and, per MoE layer, its expert ids [tokens, top_k] (packed order)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    picks = {index: [] for index in range(len(gates))}
    for index, gate in enumerate(gates):
        gate.register_forward_hook(lambda _m, _i, output, index=index: picks[index].append(output[2]))
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor(t)[None]).logits[0] for t in tokens])
    return logits, [torch.cat(picks[index]) for index in range(len(gates))]


def _megatron_pass(chunks, hf_config, replay, inputs, stage, routing):
    from slime.backends.megatron_utils.log_probs import output_weight
    from slime.backends.routing_replay import ReplayStage

    maps = []
    handles = [layer.mlp.router.register_forward_hook(lambda _m, _i, output: maps.append(output[1].clone()))
               for layer in chunks[0].decoder.layers if hasattr(layer.mlp, "router")]
    replay.stage = ReplayStage(stage)
    with torch.no_grad(), replay.micro_batch(routing):
        hidden = chunks[0](inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
    for handle in handles:
        handle.remove()
    return (hidden @ output_weight(chunks[0], hf_config.vocab_size).t())[0], maps


def _routing_record(replay, moe_layers, picks, num_hidden_layers):
    """[tokens, replay.num_layers, top_k] with every MoE layer's ids at its column (the replay's layer axis counts
    MoE layers, or every hidden layer in SGLang's layout)."""
    from slime.backends.routing_replay import FREE_ROW

    routing = torch.full((picks[0].shape[0], replay.num_layers, replay.top_k), FREE_ROW, dtype=torch.int32)
    for index, layer in enumerate(moe_layers):
        routing[:, layer if replay.num_layers == num_hidden_layers else index] = picks[index].int()
    return routing


def _as_map(ids, num_experts):
    return torch.zeros(ids.shape[0], num_experts, dtype=torch.bool).scatter_(1, ids.long(), True)


def test_replay_reproduces_the_engines_grouped_routing(checkpoints):
    from slime.backends.megatron_utils.micro_batches import thd_input
    from slime.backends.megatron_utils.moe_router import install_routers
    from slime.backends.megatron_utils.parallel import destroy_model_parallel
    from slime.backends.packing import pack_samples

    engine, trainer = checkpoints
    chunks, hf_config = build_megatron(make_megatron_args(trainer), 0, 1, find_free_port())
    try:
        replay = install_routers(chunks, hf_config)
        generator = torch.Generator().manual_seed(3)
        tokens = [torch.randint(3, hf_config.vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]
        inputs = thd_input(pack_samples(tokens, [2] * len(tokens), list(range(len(tokens)))), torch.device("cpu"),
                           pad_multiple=1)
        chunks[0].eval()
        engine_logits, engine_picks = _hf_logits_and_routing(engine, tokens)
        trainer_logits, trainer_picks = _hf_logits_and_routing(trainer, tokens)
        moe_layers = [index for index, layer in enumerate(chunks[0].decoder.layers) if hasattr(layer.mlp, "router")]
        moved = [(_as_map(a, 8) != _as_map(b, 8)).any(-1) for a, b in zip(engine_picks, trainer_picks)]
        assert all(m.any() for m in moved)  # the perturbed biases move tokens in every MoE layer
        group_moved = [((_as_map(a, 8).view(-1, 4, 2).any(-1)) != (_as_map(b, 8).view(-1, 4, 2).any(-1))).any(-1)
                       for a, b in zip(engine_picks, trainer_picks)]
        assert any(m.any() for m in group_moved)  # ... and across groups

        routing = _routing_record(replay, moe_layers, engine_picks, hf_config.num_hidden_layers)
        replayed, maps = _megatron_pass(chunks, hf_config, replay, inputs, "replay_forward", routing)
        for received, picks in zip(maps, engine_picks):
            assert torch.equal(received, _as_map(picks, 8))
        torch.testing.assert_close(replayed, engine_logits, rtol=0, atol=1e-4)
        agreement = replay.take_agreement()
        agreement = agreement[agreement[:, 1] > 0]
        fractions = agreement[:, 0] / agreement[:, 1]
        # The first MoE layer sees the same hidden states in both models: its free picks are B's exactly; later
        # layers see A's (replayed) hidden states, where B's biases pick otherwise for some tokens too.
        assert float(fractions[0]) == pytest.approx(1 - float(moved[0].float().mean()))
        assert all(0 < fraction < 1 for fraction in fractions.tolist())

        for stage in ("fallthrough", "record"):  # routing freely: the trainer's own biases and group limits
            free, maps = _megatron_pass(chunks, hf_config, replay, inputs, stage, None)
            for received, picks in zip(maps, trainer_picks):
                assert torch.equal(received, _as_map(picks, 8))
            torch.testing.assert_close(free, trainer_logits, rtol=0, atol=1e-4)
            assert (free - engine_logits).abs().max() > 1e-2
        (record,) = replay.take_records()
        for index, layer in enumerate(moe_layers):
            column = layer if replay.num_layers == hf_config.num_hidden_layers else index
            assert torch.equal(_as_map(record[:, column], 8), _as_map(trainer_picks[index], 8))
    finally:
        destroy_model_parallel()
