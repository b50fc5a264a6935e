"""Decoding the engine's routed experts into `Sample.rollout_routed_experts` in SGLang's layout: a row per position
with an entry for EVERY decoder layer (a GLM-4.5 config whose first layer is dense: 3 entries, not 2), a
continuation appended after the rows the sample holds, and the MoE-layers-only layout refused with the shapes named."""

import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest

from slime.rollout.routed_experts import routed_experts_request, store_routed_experts
from slime.utils.moe_config import moe_layer_indices, routing_shape
from slime.utils.types import Sample

GLM4_MOE = {"model_type": "glm4_moe", "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
            "num_experts_per_tok": 2}


@pytest.fixture
def args(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM4_MOE))
    return SimpleNamespace(use_rollout_routing_replay=True, hf_checkpoint=str(tmp_path))


def payload(rows: np.ndarray) -> dict:
    return {"routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")}


def test_every_decoder_layer_has_an_entry(args):
    assert moe_layer_indices(GLM4_MOE) == (1, 2) and routing_shape(args.hf_checkpoint) == (3, 2)
    sample = Sample(index=0, group_index=0, tokens=list(range(6)))
    rows = np.arange(5 * 3 * 2).reshape(5, 3, 2) % 8
    rows[:, 0] = 0  # the dense layer's entries, as SGLang writes them
    store_routed_experts(args, sample, payload(rows), start_len=0)
    np.testing.assert_array_equal(sample.rollout_routed_experts, rows)
    sample.tokens += [6, 7]  # a second turn: only the new positions come back
    assert routed_experts_request(args, sample) == {"return_routed_experts": True, "routed_experts_start_len": 5}
    store_routed_experts(args, sample, payload(rows[:2] + 1), start_len=5)
    assert sample.rollout_routed_experts.shape == (7, 3, 2)
    np.testing.assert_array_equal(sample.rollout_routed_experts[5:], rows[:2] + 1)


def test_moe_layers_only_layout_is_refused(args):
    sample = Sample(index=4, group_index=1, tokens=list(range(6)))
    with pytest.raises(ValueError, match=r"sample 4 \(group 1\): routed_experts holds 20 ids, expected 5 positions "
                                         r"x 3 decoder layers x top-2"):
        store_routed_experts(args, sample, payload(np.zeros((5, 2, 2))), start_len=0)
