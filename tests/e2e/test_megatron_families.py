"""GRPO through train.py with --train-backend megatron on tiny GLM-4 (Glm4ForCausalLM) and GLM-4.5
(Glm4MoeForCausalLM: a leading dense layer, biased sigmoid router with 4 groups / 2 kept, a shared expert)
checkpoints: real Ray, the built-in engine behind sglang-router, megatron-core on the CPU (local spec, gloo).
GLM-4.5 runs with R3 (--use-rollout-routing-replay): the engine's routing, in SGLang's every-layer layout, replayed
by megatron-core's grouped routers. The trainer's and the engine's log-probs of the same tokens stay together (fp32
on both sides, the same weights after every sync): exp(train - rollout) within 1e-4 of 1 from its 1st to its 99th
percentile, also after training moved the weights. The same runs as tests/e2e/test_glm.py's FSDP ones.

DeepSeek-V3 (multi-head latent attention with q_lora and DeepSeek-YaRN, 4 expert groups of which 2 are kept) runs
with R3 too, the engine's latent KV cache on one side, megatron-core's MLA on the local spec on the other."""

import pytest

from tests.e2e.test_glm import _check_rows, run_grpo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("megatron.core")

MEGATRON = ("--train-backend", "megatron")


def test_glm4_grpo_megatron(tmp_path):
    _check_rows(run_grpo(tmp_path, "glm4", *MEGATRON))


def test_glm4_moe_grpo_megatron_with_rollout_routing_replay(tmp_path):
    rows = run_grpo(tmp_path, "glm4_moe", *MEGATRON, "--use-rollout-routing-replay")
    _check_rows(rows)
    for row in rows:
        assert row["train/router_agreement"] > 0.9  # same weights, fp32: the trainer's own choice agrees


def test_deepseek_v3_grpo_megatron_with_rollout_routing_replay(tmp_path, monkeypatch):
    import tests.e2e.test_glm as glm_e2e

    monkeypatch.setitem(glm_e2e.TINY, "deepseek_v3", dict(n_group=4, topk_group=2, num_hidden_layers=3,
                                                          first_k_dense_replace=1))
    rows = run_grpo(tmp_path, "deepseek_v3", *MEGATRON, "--use-rollout-routing-replay")
    _check_rows(rows)
    for row in rows:
        assert row["train/router_agreement"] > 0.9
