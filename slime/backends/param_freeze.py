"""slime's parameter freezing: --only-train-params-name-list (train only the parameters a regex matches) and
--freeze-params-name-list (freeze those a regex matches), `re.search` against the backend's parameter names (Hugging
Face names with FSDP, e.g. `model.embed_tokens.weight`; megatron-core names with Megatron, e.g.
`embedding.word_embeddings.weight`, layers numbered over the whole model).

A frozen parameter gets `requires_grad = False` before the optimizer is built, so it has no gradient and no
optimizer state; it stays in the weights pushed to the engines and in checkpoints. A pattern that matches no
parameter of the model is an error naming it.

Not the optimizer (the backends pass it the trainable parameters only).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch


def freezing_flag(args) -> tuple[str, list[str]] | None:
    """(flag, patterns) of the freezing flag that is set, or None."""
    if args.only_train_params_name_list:
        return "--only-train-params-name-list", list(args.only_train_params_name_list)
    if args.freeze_params_name_list:
        return "--freeze-params-name-list", list(args.freeze_params_name_list)
    return None


def freeze_parameters(args, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                      sum_over_ranks: Callable[[list[int]], list[int]] = lambda counts: counts) -> None:
    """Set requires_grad by the freezing flag (nothing without one). `sum_over_ranks` adds up the per-pattern match
    counts over the processes that hold different parts of the model (pipeline stages), so that a pattern counts
    as matched when any of them matched it."""
    chosen = freezing_flag(args)
    if chosen is None:
        return
    flag, patterns = chosen
    compiled = [re.compile(pattern) for pattern in patterns]
    train_only = flag == "--only-train-params-name-list"
    counts = [0] * len(patterns)
    names = []
    for name, param in named_parameters:
        names.append(name)
        matched = [i for i, regex in enumerate(compiled) if regex.search(name)]
        for i in matched:
            counts[i] += 1
        param.requires_grad_(bool(matched) if train_only else not matched)
    unmatched = [pattern for pattern, count in zip(patterns, sum_over_ranks(counts)) if count == 0]
    if unmatched:
        raise ValueError(f"{flag}: {', '.join(map(repr, unmatched))} matches no parameter of the model "
                         f"(re.search over names such as {', '.join(names[:3])})")
