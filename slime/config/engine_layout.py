"""The rules of an engine's device layout: how many devices one rollout engine spans and how they split.

`--rollout-num-gpus-per-engine N` is the engine's size: with the built-in engine N ranks of one engine (tensor
parallel, `tp_size` N; `--sglang-ep-size M` splits the MoE experts over M of them), with `--rollout-backend sglang`
SGLang's `--tp-size`. An engine's ranks all run on one node. Not the placement itself (slime/ray/placement_group.py
gives engine i the devices [offset + i*N, offset + (i+1)*N)) and not the engine's own checks (engine/config.py).
"""

from __future__ import annotations

from slime.config.errors import require

# SGLang flags that reshape an engine's ranks in ways the built-in engine does not: refused with it (not ignored, so
# that a recipe never runs another layout than the one it names).
RESHAPING_SGLANG_FLAGS = {
    "sglang_pp_size": "--sglang-pp-size (pipeline-parallel engine ranks)",
    "sglang_dp_size": "--sglang-dp-size (data-parallel attention inside an engine)",
    "sglang_moe_dp_size": "--sglang-moe-dp-size (data-parallel MoE inside an engine)",
}


def builtin_engine_gaps(args) -> list[str]:
    """What of the run's engine layout the built-in engine does not run (empty: it runs all of it): an engine wider
    than a node (slime's DeepSeek / Kimi recipes span nodes), or SGLang's pipeline / data-parallel reshaping."""
    if getattr(args, "rollout_external_engine_addrs", None) is not None:
        return []  # external engines have layouts of their own
    gaps = []
    if args.rollout_num_gpus_per_engine > args.num_gpus_per_node:
        gaps.append(f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} spans nodes "
                    f"(--num-gpus-per-node {args.num_gpus_per_node})")
    gaps += [f"{what} {getattr(args, dest)}" for dest, what in RESHAPING_SGLANG_FLAGS.items()
             if getattr(args, dest, None) not in (None, 1)]
    return gaps


def check_engine_layout(args) -> None:
    """Parse-time rules of --rollout-num-gpus-per-engine (and --sglang-ep-size with the built-in engine)."""
    per_engine = args.rollout_num_gpus_per_engine
    require(args.rollout_num_gpus % per_engine == 0,
            f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of "
            f"--rollout-num-gpus-per-engine {per_engine}")
    if args.rollout_external or args.rollout_backend != "slime":
        return  # the engines run elsewhere, or SGLang lays out its own ranks (across nodes too, as in slime)
    require(per_engine <= args.num_gpus_per_node,
            f"--rollout-num-gpus-per-engine {per_engine} is larger than --num-gpus-per-node "
            f"{args.num_gpus_per_node}: an engine's ranks all run on one node; lower --rollout-num-gpus-per-engine "
            "(or raise --num-gpus-per-node if the nodes have more devices, or use --rollout-backend sglang, whose "
            "engines may span nodes)")
    for dest, what in RESHAPING_SGLANG_FLAGS.items():
        value = getattr(args, dest, None)
        require(value is None or value == 1,
                f"{what} {value}: the built-in engine shards over all --rollout-num-gpus-per-engine ranks by tensor "
                "(and --sglang-ep-size expert) parallelism only; drop the flag or use --rollout-backend sglang")
    ep_size = args.sglang_ep_size or 1
    require(per_engine % ep_size == 0,
            f"--sglang-ep-size {ep_size} must divide --rollout-num-gpus-per-engine {per_engine} (the built-in "
            "engine's experts split into --sglang-ep-size blocks over its ranks)")
