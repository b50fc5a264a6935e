"""`--custom-config-path`: a YAML mapping whose entries become attributes of args (slime's semantics: set after
validation, overriding a flag of the same name), for plugin settings that have no flag.

Not a second way to pass slime's own flags: an entry that names a flag overrides the validated value and is not
validated again, so it is logged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from slime.config.errors import ArgumentError

logger = logging.getLogger(__name__)


def apply_custom_config(args) -> None:
    if not args.custom_config_path:
        return
    path = Path(args.custom_config_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ArgumentError(f"--custom-config-path {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"--custom-config-path {path}: expected a mapping of name: value, got "
                            f"{type(data).__name__}")
    for key, value in data.items():
        if hasattr(args, key):
            logger.info("--custom-config-path %s: %s=%r overrides %r", path, key, value, getattr(args, key))
        setattr(args, key, value)
