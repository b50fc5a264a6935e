"""Evaluation datasets and their settings (slime's `slime.utils.eval_config`): `--eval-config` YAML or
`--eval-prompt-data name path ...`, resolved per dataset as dataset entry > `eval.defaults` > flags.

`--eval-config` holds `eval: {defaults: {...}, datasets: [{name, path, ...}]}` (or the mapping itself; datasets may be
a mapping keyed by name). Each dataset becomes an `EvalDatasetConfig`. The keys this project acts on: the row keys
(input/label/tool/metadata), apply_chat_template(_kwargs), n_samples_per_eval_prompt, the sampling settings
(temperature, top_p, top_k, max_response_len, stop, stop_token_ids, min_new_tokens, skip_special_tokens,
no_stop_trim), rm_type / custom_rm_path / custom_generate_function_path and metadata_overrides. slime's other keys
parse (so its configs load) but a run that sets one is an error (`check_supported`). Plain YAML: OmegaConf
interpolation (`${...}`) is not resolved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

_MISSING = object()

# field -> the args attributes it falls back to, in order (slime's DATASET_RUNTIME_SPECS / DATASET_SAMPLE_SPECS).
ARG_FALLBACKS = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "min_eval_samples": (),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "multimodal_keys": ("multimodal_keys",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("eval_custom_rm_path", "custom_rm_path"),
}
# slime's keys that parse but have no implementation here.
UNSUPPORTED_KEYS = ("repetition_penalty", "app_service", "eval_task_timeout", "min_eval_samples",
                    "eval_early_stop_remaining", "eval_early_stop_idle_timeout", "message_processor", "reward_model",
                    "remote_environment")


@dataclass
class EvalDatasetConfig:
    """One evaluation dataset and its settings (None: fall back to the flags)."""

    name: str
    path: str
    rm_type: str | None = None
    custom_rm_path: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    multimodal_keys: dict[str, str] | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict[str, Any] | None = None
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_generate_function_path: str | None = None
    app_service: str | None = None
    eval_task_timeout: int | None = None
    min_eval_samples: int | None = None
    eval_early_stop_remaining: int | None = None
    eval_early_stop_idle_timeout: float | None = None
    message_processor: dict[str, Any] | None = None
    reward_model: dict[str, Any] | None = None
    remote_environment: dict[str, Any] | None = None
    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metadata_overrides is None:
            self.metadata_overrides = {}
        if not isinstance(self.metadata_overrides, dict):
            raise TypeError(f"eval dataset {self.name}: metadata_overrides must be a mapping")
        if self.min_eval_samples is not None and self.min_eval_samples <= 0:
            raise ValueError("min_eval_samples must be positive when set.")

    @property
    def cache_key(self) -> tuple:
        return self.name, self.path, self.input_key, self.label_key, self.tool_key, self.metadata_key

    def inject_metadata(self, sample_metadata: Any) -> dict[str, Any]:
        """A sample's metadata with this dataset's rm_type and metadata_overrides applied."""
        metadata = dict(sample_metadata) if isinstance(sample_metadata, dict) else {}
        if self.rm_type is not None:
            metadata["rm_type"] = self.rm_type
        metadata.update(self.metadata_overrides)
        return metadata


def ensure_dataset_list(config: Any) -> list[dict[str, Any]]:
    """The datasets of an eval config as a list of dicts (a mapping keyed by name also works)."""
    if config is None:
        return []
    if isinstance(config, dict):
        return [{**dict(cfg or {}), "name": dict(cfg or {}).get("name", name)} for name, cfg in config.items()]
    if isinstance(config, (list, tuple)):
        datasets = [dict(item or {}) for item in config]
        if any("name" not in d for d in datasets):
            raise ValueError("Each evaluation dataset entry must include a `name` field.")
        return datasets
    raise TypeError("eval.datasets must be either a list or a mapping.")


def _from_args(args, attrs: tuple[str, ...]):
    for attr in attrs:
        value = getattr(args, attr, None)
        if value is not None:
            return value
    return None


def build_eval_dataset_configs(args, raw_config: Iterable[dict[str, Any]], defaults: dict[str, Any]
                               ) -> list[EvalDatasetConfig]:
    """EvalDatasetConfigs with every field resolved: dataset entry > defaults > flags (ARG_FALLBACKS)."""
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in fields(EvalDatasetConfig)}
    if unknown:
        raise ValueError(f"Unknown key(s) in eval.defaults: {sorted(unknown)}. "
                         f"Valid keys: {sorted(f.name for f in fields(EvalDatasetConfig))}.")
    datasets = []
    for entry in raw_config:
        resolved = {**defaults, **dict(entry or {})}
        for name, attrs in ARG_FALLBACKS.items():
            if resolved.get(name, _MISSING) is _MISSING:
                resolved[name] = _from_args(args, attrs)
        datasets.append(EvalDatasetConfig(**resolved))
    return datasets


def load_eval_config(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(dataset entries, defaults) of an `--eval-config` YAML file."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--eval-config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--eval-config must contain a mapping at the root.")
    eval_config = config.get("eval", config)
    if not isinstance(eval_config, dict):
        raise ValueError("--eval-config must define an `eval` mapping or be a mapping itself.")
    datasets = ensure_dataset_list(eval_config.get("datasets"))
    if not datasets:
        raise ValueError(f"--eval-config {path} does not define any datasets under `eval.datasets`.")
    return datasets, dict(eval_config.get("defaults") or {})


def check_supported(dataset: EvalDatasetConfig) -> None:
    """ValueError if the dataset sets one of slime's keys this project does not act on."""
    for key in UNSUPPORTED_KEYS:
        if getattr(dataset, key) is not None:
            raise ValueError(f"eval dataset {dataset.name}: {key} is not supported here (docs/migrating/slime-compat.md)")


def parse_eval_prompt_data(value) -> list[tuple[str, str]]:
    """`--eval-prompt-data name path [name path ...]` -> [(name, path)]; a single path is named "eval" (slime:
    "aime"; a dataset's name should not claim what it is not)."""
    if not value:
        return []
    items = [value] if isinstance(value, str) else list(value)
    if len(items) == 1:
        return [("eval", items[0])]
    if len(items) % 2:
        raise ValueError(f"--eval-prompt-data takes pairs 'name path [name path ...]', got {items}")
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


def resolve_eval_datasets(args) -> list[EvalDatasetConfig]:
    """The run's eval datasets from --eval-config, else --eval-prompt-data."""
    if args.eval_config:
        entries, defaults = load_eval_config(args.eval_config)
    else:
        pairs = parse_eval_prompt_data(args.eval_prompt_data)
        entries, defaults = [{"name": name, "path": path} for name, path in pairs], {}
    datasets = build_eval_dataset_configs(args, entries, defaults)
    for dataset in datasets:
        check_supported(dataset)
    return datasets
