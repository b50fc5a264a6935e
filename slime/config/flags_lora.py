"""LoRA flags (Miles' names and defaults) and their rules, in one file so the LoRA surface reads in one place.

`--lora-rank R` (> 0) trains low-rank adapters on the `--target-modules` linear layers of the policy while the base
model stays frozen; the frozen base with the adapters disabled is the reference model (no second copy). Adapters
are saved in PEFT's format and pushed to the engines unmerged (docs/guides/lora.md).

Derived fields: `args.lora_target_modules`, the adapted layers as sorted Hugging Face leaf names (`q_proj`, ...),
whatever spelling the flag used; `args.lora_path`, the adapter name the rollout's /generate requests ask for (None
until the first push; the RolloutManager sets it to `policy@<version>` after each verified push); with several
adapters (--lora-adapter-key) `args.lora_paths` instead, {adapter: `<adapter>@<version>`}, read per sample by
`request_lora_path`. Parsing (`add_lora_arguments`, registered in arguments.py) and the rules (`check_lora_args`,
called from validate.py once the backend and layout are resolved).

Not the adapters themselves (slime/backends/: lora_adapter.py, fsdp_utils/lora.py, megatron_utils/lora.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from slime.config.errors import ArgumentError, require
from slime.utils.hf_config import hf_text_config

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Megatron's fused layers and the HF layers they hold (Miles: linear_qkv -> q/k/v, linear_fc1 -> gate/up).
MEGATRON_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                    "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
SERVED_ADAPTER_NAME = "policy"  # the engines serve version V of the trained adapter as `policy@V`


ADAPTER_METADATA_KEY = "lora_adapter"  # Sample.metadata's field naming the sample's adapter (--lora-adapter-key)


def served_adapter_name(weight_version, adapter: str = SERVED_ADAPTER_NAME) -> str:
    """The name under which the engines serve `adapter` at `weight_version` (the trainer loads it, the rollout
    asks for it with `lora_path`): `policy@V`, or `<adapter>@V` for one of --lora-adapter-names."""
    return f"{adapter}@{weight_version}"


def trained_adapter_names(args) -> list[str]:
    """The adapters the run trains: --lora-adapter-names, or the one adapter `policy`."""
    return list(args.lora_adapter_names) if args.lora_adapter_key else [SERVED_ADAPTER_NAME]


def request_lora_path(args, metadata: dict) -> str | None:
    """The `lora_path` of a /generate request for a sample with `metadata`: the version last pushed of its adapter
    (--lora-adapter-key: the one its data row names), or None (the base) before any push or without LoRA."""
    if not args.lora_adapter_key:
        return args.lora_path
    return (args.lora_paths or {}).get(metadata.get(ADAPTER_METADATA_KEY))


def serves_adapter(args) -> bool:
    """Whether the engines serve the trained adapter (else they stay on the base: no LoRA, or --lora-train-only)."""
    return args.lora_rank > 0 and not args.lora_train_only


def add_lora_arguments(parser):
    g = parser.add_argument_group("LoRA (docs/guides/lora.md)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="rank of the LoRA adapters; 0 (default) trains the full model. > 0: only the adapters train, "
                        "the base stays frozen and, with the adapters disabled, is the reference model")
    g.add_argument("--lora-alpha", type=int, default=16,
                   help="the adapter output is scaled by lora_alpha / lora_rank")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapter input in training forwards (RL recipes keep 0)")
    g.add_argument("--target-modules", default=None,
                   help="layers that get adapters (required with --lora-rank > 0, as in Miles): all-linear (the q, k, "
                        "v, o, gate, up and down projections) or a comma list of HF leaf names (q_proj,v_proj) or Megatron names "
                        "(linear_qkv,linear_proj,linear_fc1,linear_fc2)")
    g.add_argument("--exclude-modules", default=None,
                   help="comma list of HF leaf names (or Megatron names) removed after --target-modules is expanded")
    g.add_argument("--lora-adapter-path", default=None,
                   help="start from this PEFT adapter folder (adapter_config.json + adapter_model.safetensors); its r "
                        "and lora_alpha must equal --lora-rank and --lora-alpha")
    g.add_argument("--lora-train-only", action="store_true",
                   help="train the adapters but keep the engines on the frozen base: no adapter is pushed (for "
                        "engines that cannot serve adapters; the rollouts then sample the base policy)")
    g.add_argument("--lora-adapter-key", default=None,
                   help="several adapters in one run: the data rows' field naming each prompt's adapter (one of "
                        "--lora-adapter-names). Each adapter trains on its own prompts with its own optimizer state "
                        "and gradient clipping, is pushed and verified as <name>@<version>, and the rollout asks "
                        "for it per request (FSDP backend)")
    g.add_argument("--lora-adapter-names", default=None, type=lambda text: _split(text),
                   help="with --lora-adapter-key: the adapters trained, comma separated (e.g. math,code)")
    g.add_argument("--check-lora-weight-equal", action="store_true",
                   help="every adapter push is verified by the engines' per-tensor checksums; this also requires the "
                        "tensors sent to equal the trainer's parameters exactly (a push in a lower-precision engine "
                        "dtype, e.g. fp32 adapters into a bf16 engine, fails naming the tensor)")


def _split(value: str | None) -> list[str]:
    return [name.strip() for name in (value or "").split(",") if name.strip()]


def _hf_names(flag: str, names: list[str]) -> set[str]:
    known = set(ATTENTION_TARGETS) | set(MLP_TARGETS)
    result: set[str] = set()
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in MEGATRON_TARGETS:
            result.update(MEGATRON_TARGETS[leaf])
        elif leaf == "gate_up_proj":  # a checkpoint's own fused gate/up layer (GLM-4)
            result.update(("gate_proj", "up_proj"))
        elif leaf in known:
            result.add(leaf)
        else:
            raise ArgumentError(f"{flag}: {name!r} is not a layer LoRA can adapt here; use all-linear or names among "
                                f"{', '.join(sorted(known))} (HF) or {', '.join(MEGATRON_TARGETS)} (Megatron)")
    return result


def resolve_target_modules(target_modules: str | None, exclude_modules: str | None, hf_config: dict) -> list[str]:
    """The adapted layers as sorted HF leaf names. An MoE model's MLP layers are its experts, which the adapters
    here do not cover: asking for them is an error naming --target-modules."""
    names = _split(target_modules)
    if names == ["all-linear"]:
        chosen = set(ATTENTION_TARGETS) | set(MLP_TARGETS)
    else:
        if "all-linear" in names:
            raise ArgumentError("--target-modules: all-linear stands alone (not inside a comma list)")
        chosen = _hf_names("--target-modules", names)
    chosen -= _hf_names("--exclude-modules", _split(exclude_modules))
    if not chosen:
        raise ArgumentError("--exclude-modules removes every layer of --target-modules: nothing would train")
    if any(hf_config.get(key) for key in EXPERT_COUNT_KEYS) and chosen & set(MLP_TARGETS):
        raise ArgumentError(
            "--target-modules: this is an MoE model and LoRA here does not adapt expert layers "
            f"({', '.join(sorted(chosen & set(MLP_TARGETS)))}); pass --target-modules q_proj,k_proj,v_proj,o_proj "
            "(attention only) or --exclude-modules gate_proj,up_proj,down_proj")
    return sorted(chosen)


def read_adapter_config(path: str | Path) -> dict:
    """A PEFT folder's adapter_config.json; ValueError naming --lora-adapter-path if the folder is not one."""
    folder = Path(path)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ArgumentError(f"--lora-adapter-path {path}: no {name} (expected a PEFT adapter folder, as "
                                f"--save writes under rollout_<id>/adapter/)")
    return json.loads((folder / ADAPTER_CONFIG_FILE).read_text())


def check_lora_args(args) -> None:
    """Once the backend and its parallel layout are resolved. Sets args.lora_target_modules."""
    args.lora_target_modules = []
    args.lora_path = None
    args.lora_paths = {}  # --lora-adapter-key: adapter name -> the served name of its version last pushed
    if args.lora_rank == 0:
        for flag, dest in (("--lora-adapter-path", "lora_adapter_path"), ("--lora-train-only", "lora_train_only"),
                           ("--lora-adapter-key", "lora_adapter_key"), ("--lora-adapter-names", "lora_adapter_names"),
                           ("--check-lora-weight-equal", "check_lora_weight_equal"),
                           ("--target-modules", "target_modules"), ("--exclude-modules", "exclude_modules")):
            require(not getattr(args, dest), f"{flag} configures LoRA training: pass --lora-rank R (R > 0) too")
        return
    require(bool(_split(args.target_modules)),
            "--lora-rank > 0 needs --target-modules: all-linear, or a comma list such as q_proj,k_proj,v_proj,o_proj")
    hf_config = hf_text_config(args) if args.hf_checkpoint and Path(args.hf_checkpoint, "config.json").is_file() else {}
    args.lora_target_modules = resolve_target_modules(args.target_modules, args.exclude_modules, hf_config)
    require(not (args.only_train_params_name_list or args.freeze_params_name_list),
            "--only-train-params-name-list / --freeze-params-name-list: with --lora-rank > 0 only the adapters "
            "train and the whole base is frozen; drop the freezing flag")
    require(not args.ref_update_interval,
            "--ref-update-interval: with --lora-rank > 0 the reference is the frozen base (adapters disabled), "
            "which never follows the actor; drop --ref-update-interval")
    require(not (args.check_lora_weight_equal and args.lora_train_only),
            "--check-lora-weight-equal checks adapter pushes, which --lora-train-only turns off; pass one of them")
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    require(args.lora_dropout == 0.0 or args.train_backend != "megatron" or tp == 1,
            f"--lora-dropout {args.lora_dropout} with --tensor-model-parallel-size {tp}: the adapter input of a "
            "column-parallel layer is replicated over the TP ranks and their dropout masks are not kept equal; "
            "use --lora-dropout 0 (as RL recipes do) or --tensor-model-parallel-size 1")
    if args.train_backend == "megatron":
        require(not args.sequence_parallel,
                "--lora-rank > 0 with --sequence-parallel: the Megatron backend's adapters take the layer input as "
                "the tensor-parallel region sees it, not sequence-sharded; drop --sequence-parallel")
        for layer, held in MEGATRON_TARGETS.items():
            partial = set(held) & set(args.lora_target_modules)
            require(not partial or partial == set(held),
                    f"--target-modules: the Megatron backend adapts the fused {layer} as one layer "
                    f"({', '.join(held)}): target all of them or none (got {', '.join(sorted(partial))})")
    check_several_adapters(args)
    if args.lora_adapter_path:
        config = read_adapter_config(args.lora_adapter_path)
        require(config.get("r") == args.lora_rank and config.get("lora_alpha") == args.lora_alpha,
                f"--lora-adapter-path {args.lora_adapter_path}: its adapter has r={config.get('r')}, lora_alpha="
                f"{config.get('lora_alpha')}; pass --lora-rank {config.get('r')} --lora-alpha "
                f"{config.get('lora_alpha')}")
        saved = config.get("target_modules")
        saved = sorted(_hf_names("--lora-adapter-path (its target_modules)", saved)) if isinstance(saved, list) else saved
        require(saved == args.lora_target_modules,
                f"--lora-adapter-path {args.lora_adapter_path}: its adapter covers {saved}, --target-modules "
                f"resolves to {args.lora_target_modules}; pass --target-modules {','.join(saved or [])}")


def check_several_adapters(args) -> None:
    """--lora-adapter-key / --lora-adapter-names: what several adapters in one run need."""
    names = args.lora_adapter_names or []
    require(bool(args.lora_adapter_key) == bool(names),
            "--lora-adapter-key and --lora-adapter-names go together: the key names each row's adapter, the names "
            "list the adapters trained (e.g. --lora-adapter-key task --lora-adapter-names math,code)")
    if not names:
        return
    require(len(set(names)) == len(names), f"--lora-adapter-names {','.join(names)}: a name is given twice")
    for name in names:
        require(name.replace("_", "").replace("-", "").isalnum(),
                f"--lora-adapter-names: {name!r} must be letters, digits, '_' or '-' (it names a module and a folder)")
    require(args.train_backend == "fsdp",
            "--lora-adapter-key (several adapters in one run) is built on the FSDP backend; pass --train-backend fsdp")
    require(not args.lora_adapter_path,
            "--lora-adapter-path starts one adapter; with --lora-adapter-key the adapters start fresh (resume a "
            "run of several adapters with --load)")
    require(not args.save_hf, "--save-hf writes one merged model; with --lora-adapter-key there is one per adapter: "
                              "merge the adapter you want from the checkpoint's adapter/<name>/ folder")
    slots = getattr(args, "sglang_max_loras_per_batch", None)
    needed = 2 * len(names)  # each adapter's new version and the previous one (lora_push.KEEP_VERSIONS)
    require(args.lora_train_only or slots is None or slots >= needed,
            f"--sglang-max-loras-per-batch {slots}: {len(names)} adapters need {needed} engine slots (each adapter's "
            f"new version and the previous one); pass --sglang-max-loras-per-batch {needed}")
