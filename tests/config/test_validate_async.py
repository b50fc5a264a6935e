"""The fully async flags' rules: each refusal names the flag and the fix; the alias and the derived default."""

import pytest

from slime.config.errors import ArgumentError
from tests.helpers.args_helpers import make_args

BASE = ("--fully-async", "--use-tis", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2")


def test_alias_and_defaults():
    args = make_args(*BASE, "--max-policy-version-lag", "3")
    assert args.max_weight_staleness == 3
    assert args.async_max_concurrent_samples == 8  # one batch of samples
    assert make_args(*BASE, "--over-sampling-batch-size", "6").async_max_concurrent_samples == 12


@pytest.mark.parametrize("extra, message", [
    (("--max-weight-staleness", "1"), "--max-weight-staleness bounds --fully-async"),
    (("--async-max-concurrent-samples", "4"), "--async-max-concurrent-samples needs --fully-async"),
])
def test_flags_of_the_mode_need_the_mode(extra, message):
    with pytest.raises(ArgumentError, match=message):
        make_args(*extra)


@pytest.mark.parametrize("extra, message", [
    (("--colocate",), "drop --colocate"),
    (("--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"), "--rollout-function-path"),
    (("--use-rollout-logprobs",), "--use-tis"),
    (("--keep-old-actor",), "--keep-old-actor"),
    (("--max-weight-staleness", "-1"), "must be >= 0"),
    (("--max-weight-staleness", "0", "--update-weights-interval", "2"), "raise it to >= 1"),
    (("--async-max-concurrent-samples", "1"), "below one group"),
    (("--async-data-buffer-capacity-factor", "0.5"), "must be >= 1"),
    (("--disable-rollout-global-dataset",), "--rollout-global-dataset"),
])
def test_refusals_name_the_flag(extra, message):
    with pytest.raises(ArgumentError, match=message):
        make_args(*BASE, *extra)


def test_without_tis_is_refused():
    with pytest.raises(ArgumentError, match="pass --use-tis"):
        make_args("--fully-async", "--rollout-batch-size", "4")
