"""`--sglang-*` and `--router-*` flags as slime passes them through.

Every flag of SGLang's server (`ServerArgs`, snapshot in `sglang_server_flags.json`, less the ones slime sets itself)
is accepted as `--sglang-<flag>` with dest `sglang_<dest>` and default None (= not given: SGLang's own default
applies). With `--rollout-backend sglang` every given one goes to the SGLang server (`sglang_server_flags`). With the
built-in engine a flag that has a meaning maps onto the engine's Config (`SGLANG_FLAG_TO_ENGINE_CONFIG`); the others
are accepted and reported once at start-up. A `--sglang-*` flag SGLang does not have is an error naming the closest
spelling. `--router-*` flags are sglang-router's own (`RouterArgs.add_cli_args(use_router_prefix=True)`) and go to
the router process (`router_cli_flags`), with slime's defaults for the balance thresholds and the log level.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

from sglang_router.launch_router import RouterArgs

from slime.config.errors import ArgumentError

SNAPSHOT = json.loads((Path(__file__).with_name("sglang_server_flags.json")).read_text())
SGLANG_SERVER_FLAGS = SNAPSHOT["flags"]
SNAPSHOT_TYPES = {"int": int, "float": float}  # the snapshot's value types; other values stay strings

# Switches that store a constant into a destination a value flag also sets (SGLang's --disable-piecewise-cuda-graph
# and --enforce-piecewise-cuda-graph into cuda_graph_backend_prefill): here each keeps a destination named after
# itself, so it reaches SGLang as itself and the built-in engine can tell the switches apart.
_VALUE_DESTS = {spec["dest"] for spec in SGLANG_SERVER_FLAGS if spec["takes_value"]}


def _dest_of(spec: dict) -> str:
    """The argparse destination of a snapshot flag: sglang_<SGLang's dest>, or sglang_<flag> for the switches
    above."""
    if not spec["takes_value"] and spec["dest"] in _VALUE_DESTS:
        return "sglang_" + spec["flags"][0][2:].replace("-", "_")
    return "sglang_" + spec["dest"]


# --sglang-* flags that mean something to the built-in engine -> (Config field, type).
SGLANG_FLAG_TO_ENGINE_CONFIG = {
    "sglang_mem_fraction_static": ("gpu_memory_utilization", float),
    "sglang_context_length": ("max_model_len", int),
    "sglang_max_running_requests": ("max_num_seqs", int),
    "sglang_chunked_prefill_size": ("max_num_batched_tokens", int),
    "sglang_max_prefill_tokens": ("max_num_batched_tokens", int),
    "sglang_page_size": ("kvcache_block_size", int),
    "sglang_disable_cuda_graph": ("enforce_eager", bool),
    "sglang_cuda_graph_max_bs_prefill": ("prefill_cuda_graph_max_tokens", int),  # --piecewise-cuda-graph-max-tokens
    "sglang_disable_piecewise_cuda_graph": ("prefill_cuda_graphs", "negated bool"),
    "sglang_enforce_piecewise_cuda_graph": ("prefill_cuda_graphs", bool),
    "sglang_disable_overlap_schedule": ("overlap_schedule", "negated bool"),
    "sglang_dtype": ("dtype", str),
    "sglang_kv_cache_dtype": ("kv_cache_dtype", str),
    "sglang_ep_size": ("ep_size", int),
    "sglang_dist_timeout": ("dist_timeout_s", float),
    "sglang_enable_lora": ("enable_lora", "bool text"),  # SGLang's takes a value: --sglang-enable-lora true
    "sglang_max_lora_rank": ("max_lora_rank", int),
    "sglang_max_loras_per_batch": ("max_loras_per_batch", int),
}
# SGLang flag values the built-in engine cannot honour -> why (refused when the run uses the built-in engine).
UNSUPPORTED_BY_ENGINE = {
    ("sglang_kv_cache_dtype", "fp4_e2m1"): "the built-in engine's KV cache is in the model dtype or fp8 (fp8_e4m3, "
                                           "fp8_e5m2); fp4 needs --rollout-backend sglang",
}
# Flags of slime's own with the sglang prefix, and flags registered elsewhere (slime.utils.engine_access).
SLIME_SGLANG_FLAGS = ("--sglang-router-ip", "--sglang-router-port", "--sglang-router-request-timeout-secs",
                      "--sglang-server-concurrency", "--sglang-config")
ROUTER_DEFAULTS = {"router_balance_abs_threshold": 10, "router_balance_rel_threshold": 1.2, "router_log_level": "warn"}
# Set by the router launcher itself (slime.ray.router), not passed through.
ROUTER_OWNED = ("router_policy", "router_log_level", "router_request_timeout_secs", "router_prometheus_host",
                "router_prometheus_port", "router_api_key")


def _str2bool(value: str) -> bool:
    lowered = str(value).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def add_sglang_arguments(parser) -> None:
    g = parser.add_argument_group("sglang (slime's own --sglang-* flags, then SGLang's server flags)")
    g.add_argument("--sglang-router-ip", default=None)
    g.add_argument("--sglang-router-port", type=int, default=None)
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=14400)
    g.add_argument("--sglang-server-concurrency", type=int, default=512, help="in-flight requests per engine")
    g.add_argument("--sglang-config", default=None)
    g.add_argument("--prefill-num-servers", type=int, default=None)
    for spec in SGLANG_SERVER_FLAGS:
        flags = ["--sglang-" + flag[2:] for flag in spec["flags"]]
        flags = [flag for flag in flags if flag not in parser._option_string_actions]
        if not flags:
            continue
        dest = _dest_of(spec)
        if spec["takes_value"]:
            g.add_argument(*flags, dest=dest, default=None, nargs=spec["nargs"], choices=spec["choices"],
                           help=argparse.SUPPRESS)  # typed by type_sglang_values (SGLang checks ranges)
        else:  # a switch; `--flag=false` also works
            g.add_argument(*flags, dest=dest, default=None, nargs="?", const=True, type=_str2bool,
                           help=argparse.SUPPRESS)


def add_router_arguments(parser) -> None:
    router = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(router, use_router_prefix=True, exclude_host_port=True)
    g = parser.add_argument_group("router (sglang-router's --router-* flags)")
    for action in router._actions:
        if action.option_strings and action.dest.startswith("router_"):
            g._add_action(action)
    parser.set_defaults(**ROUTER_DEFAULTS)


def closest_flag_error(token: str, parser) -> str:
    """The message for an unknown flag: the closest spellings among the parser's flags."""
    flag = token.split("=", 1)[0]
    pool = [option for option in parser._option_string_actions if option.startswith("--")]
    if flag.startswith("--sglang-"):
        pool = [option for option in pool if option.startswith("--sglang-")]
        what = f"{flag} is not a flag of SGLang's server (sglang 0.5.15) nor of slime"
    elif flag.startswith("--router-"):
        pool = [option for option in pool if option.startswith("--router-")]
        what = f"{flag} is not a flag of sglang-router"
    else:
        what = f"unknown argument {flag}"
    matches = difflib.get_close_matches(flag, pool, n=3, cutoff=0.6)
    return what + (f"; did you mean {' or '.join(matches)}?" if matches else " (see `python train.py --help`)")


def given_sglang_flags(args) -> dict:
    """{dest: value} of the SGLang server flags this run gives (not None)."""
    dests = {_dest_of(spec) for spec in SGLANG_SERVER_FLAGS}
    return {dest: getattr(args, dest) for dest in sorted(dests) if getattr(args, dest, None) is not None}


def type_sglang_values(args) -> None:
    """The given --sglang-* values as SGLang types them (int / float; the rest stay strings); ArgumentError
    naming the flag for a value that is not one."""
    for spec in SGLANG_SERVER_FLAGS:
        dest, kind = _dest_of(spec), SNAPSHOT_TYPES.get(spec["type"])
        value = getattr(args, dest, None)
        if kind is None or value is None:
            continue
        try:
            setattr(args, dest, [kind(v) for v in value] if isinstance(value, list) else kind(value))
        except (TypeError, ValueError):
            raise ArgumentError(f"{spec['flags'][0].replace('--', '--sglang-', 1)} {value!r}: expected "
                                f"{kind.__name__}") from None


def engine_config_from_sglang_flags(args) -> tuple[dict, list[str]]:
    """(built-in engine Config fields from the given --sglang-* flags, the given flags it has no use for)."""
    config, unused = {}, []
    for dest, value in given_sglang_flags(args).items():
        if dest not in SGLANG_FLAG_TO_ENGINE_CONFIG:
            unused.append("--" + dest.replace("_", "-"))
            continue
        field, kind = SGLANG_FLAG_TO_ENGINE_CONFIG[dest]
        if (dest, value) in UNSUPPORTED_BY_ENGINE and args.rollout_backend == "slime":
            raise ArgumentError(f"--{dest.replace('_', '-')} {value}: {UNSUPPORTED_BY_ENGINE[dest, value]}")
        try:
            config[field] = ((not value) if kind == "negated bool" else _str2bool(value) if kind == "bool text"
                             else kind(value))
        except (ValueError, argparse.ArgumentTypeError):
            expected = "true or false" if isinstance(kind, str) else kind.__name__
            raise ArgumentError(f"--{dest.replace('_', '-')} {value!r}: expected {expected}") from None
    config.update(_lora_engine_config(args, config))
    return config, unused


def _lora_engine_config(args, config: dict) -> dict:
    """A LoRA run (--lora-rank > 0, flags_lora.py) serves its adapter unmerged: the engine gets enable_lora and
    max_lora_rank = --lora-rank unless --sglang-enable-lora / --sglang-max-lora-rank say otherwise; none with
    --lora-train-only (the engines stay on the base). Several adapters (--lora-adapter-names) get at least two slots
    each (every adapter's new version and the previous one) unless --sglang-max-loras-per-batch says otherwise."""
    lora_rank = getattr(args, "lora_rank", 0)  # registered by flags_lora.py; absent in parsers built without it
    if not lora_rank or getattr(args, "lora_train_only", False):
        return {}
    lora = {"enable_lora": config.get("enable_lora", True), "max_lora_rank": config.get("max_lora_rank", lora_rank)}
    names = getattr(args, "lora_adapter_names", None) or []
    if names and "max_loras_per_batch" not in config:
        lora["max_loras_per_batch"] = max(8, 2 * len(names))  # 8: the engine's default
    return lora


def sglang_server_flags(args) -> list[str]:
    """The given --sglang-* server flags as SGLang's own command-line flags (for --rollout-backend sglang)."""
    by_dest = {}
    for spec in SGLANG_SERVER_FLAGS:  # a dest some deprecated aliases share: its own flag is the canonical one
        dest = _dest_of(spec)
        if dest == "sglang_" + spec["flags"][0][2:].replace("-", "_") or dest not in by_dest:
            by_dest[dest] = spec
    command = []
    for dest, value in given_sglang_flags(args).items():
        spec = by_dest[dest]
        if not spec["takes_value"]:
            command += [spec["flags"][0]] if value else []
        else:
            command += [spec["flags"][0], *(str(v) for v in (value if isinstance(value, list) else [value]))]
    return command


def router_cli_flags(args, parser_defaults: dict) -> list[str]:
    """The --router-* flags this run changes from sglang-router's defaults, as the router's own flags."""
    router = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(router, use_router_prefix=False, exclude_host_port=True)
    by_dest = {"router_" + action.dest: action for action in router._actions if action.option_strings}
    command = []
    for dest, action in by_dest.items():
        value = getattr(args, dest, None)
        if dest in ROUTER_OWNED or value == parser_defaults.get(dest) and dest not in ROUTER_DEFAULTS:
            continue
        if action.nargs == 0:
            command += [action.option_strings[0]] if value else []
        elif value is not None:
            command += [action.option_strings[0], *(str(v) for v in (value if isinstance(value, list) else [value]))]
    return command
