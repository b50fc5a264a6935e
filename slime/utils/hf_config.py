"""The text model's config.json of a Hugging Face checkpoint, read as plain JSON (no transformers import)."""

from __future__ import annotations

import json
from pathlib import Path


def hf_text_config(args) -> dict:
    """--hf-checkpoint's config.json (a multimodal model's text_config), {} without one."""
    if args.hf_checkpoint is None:
        return {}
    config = json.loads((Path(args.hf_checkpoint) / "config.json").read_text())
    return config.get("text_config", config)
