"""Sample.token_weight_versions: one weight version per response token, from the meta_info of the response that
sampled it; None for tokens the policy did not sample; absent until some response reports a version."""

import pytest

from slime.utils.types import Sample


def meta(version, finish="stop"):
    return {"weight_version": version, "finish_reason": {"type": finish}}


def test_versions_follow_the_responses_that_sampled_the_tokens():
    sample = Sample(tokens=[1, 2])
    sample.append_response_tokens(tokens=[5, 6], log_probs=[-0.1, -0.2], meta_info=meta("3", "abort"))
    assert sample.status == Sample.Status.ABORTED
    sample.append_response_tokens(tokens=[7], log_probs=[-0.3], meta_info=meta("4"))
    sample.append_response_tokens(tokens=[8, 9], trainable=False)  # tool output between turns
    sample.append_response_tokens(tokens=[10], log_probs=[-0.4], meta_info=meta(5))
    assert sample.token_weight_versions == ["3", "3", "4", None, None, "5"]
    assert sample.weight_versions == ["3", "4", 5]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1]
    assert Sample.from_dict(sample.to_dict()).token_weight_versions == sample.token_weight_versions


def test_no_version_reported_keeps_the_field_empty_and_a_late_one_pads_the_front():
    sample = Sample(tokens=[1])
    sample.append_response_tokens(tokens=[4], log_probs=[-1.0], meta_info={"finish_reason": {"type": "length"}})
    assert sample.token_weight_versions is None
    sample.append_response_tokens(tokens=[5], log_probs=[-1.0], meta_info=meta("2"))
    assert sample.token_weight_versions == [None, "2"]


def test_a_misaligned_list_is_refused():
    sample = Sample(tokens=[1])
    sample.token_weight_versions = ["1"]
    with pytest.raises(ValueError, match="token_weight_versions length"):
        sample.append_response_tokens(tokens=[4], log_probs=[-1.0])
