"""Fully asynchronous training flags (`train_async.py --fully-async`, docs/guides/fully-async.md): Miles' names, with
slime's proposed `--max-policy-version-lag` accepted for `--max-weight-staleness`.

Miles' `--async-unused-samples-handler` has nothing to handle here: no finished group is discarded for
staleness (admission bounds it), and a checkpoint carries the buffer and the in-flight prompts.

Registration only; `validate_async.check_fully_async_flags` checks the combinations.
"""

from __future__ import annotations


def add_fully_async_arguments(parser):
    g = parser.add_argument_group("fully asynchronous training (docs/guides/fully-async.md)")
    g.add_argument("--fully-async", action="store_true",
                   help="train_async.py only: the engines generate continuously from the prompt stream, finished "
                        "groups go to a buffer, the trainer takes each batch as soon as it is ready, and weight "
                        "pushes pause in-flight requests between engine steps (they resume under the new weights); "
                        "every sampled token records the policy version that produced it")
    g.add_argument("--max-weight-staleness", "--max-policy-version-lag", dest="max_weight_staleness", type=int,
                   default=None, metavar="N",
                   help="no trained token is more than N policy versions older than the weights trained on it; "
                        "enforced by admitting prompt groups (AReaL's capacity rule, with deadlines), never by "
                        "discarding finished ones; must be >= --update-weights-interval - 1 (default: unbounded)")
    g.add_argument("--async-max-concurrent-samples", type=int, default=None,
                   help="samples generating at once (whole groups are admitted; default: one batch, "
                        "--rollout-batch-size x --n-samples-per-prompt)")
    g.add_argument("--async-data-buffer-capacity-factor", type=float, default=2.0,
                   help="finished plus generating groups are at most this x --rollout-batch-size; admission waits "
                        "while the buffer is full")
