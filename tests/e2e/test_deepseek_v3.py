"""GRPO through train.py on a tiny DeepSeek-V3 checkpoint (multi-head latent attention with q_lora and DeepSeek-YaRN,
a leading dense layer, the biased sigmoid router with 4 groups / 2 kept, a shared expert) with R3
(--use-rollout-routing-replay): real Ray, the built-in engine (latent KV cache, absorbed attention) behind
sglang-router, the FSDP trainer (transformers' DeepseekV3ForCausalLM). The trainer's and the engine's log-probs of the
same tokens stay together (fp32 on both sides, the same weights after every sync, the engine's absorbed W_UK / W_UV
following every kv_b_proj push): the ratio exp(train - rollout) within 1e-4 of 1 from its 1st to its 99th
percentile, also after training moved the weights."""

import pytest

from tests.e2e.test_glm import _check_rows, run_grpo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_deepseek_v3_grpo_with_rollout_routing_replay(tmp_path, monkeypatch):
    import tests.e2e.test_glm as glm_e2e

    # run_grpo builds its checkpoint from the architecture's entry of TINY: this family's sizes added for this test
    monkeypatch.setitem(glm_e2e.TINY, "deepseek_v3", dict(n_group=4, topk_group=2, num_hidden_layers=3,
                                                          first_k_dense_replace=1))
    rows = run_grpo(tmp_path, "deepseek_v3", "--use-rollout-routing-replay")
    _check_rows(rows)
    for row in rows:
        assert row["train/router_agreement"] > 0.9
