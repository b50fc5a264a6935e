"""The engine server's command line and its JSON config file: engine knobs (`Config` fields), who may call it
(`AccessPolicy`), and which folders it may load weights from.

Launchers (the Ray engine actor) write one JSON file, `{"model_path": ..., "engine": {Config fields},
"server": {api_key, admin_api_key, allow_remote_admin, max_request_bytes, weights_dir_allowlist}}`, readable by
the owner only, and pass `--config-file`: typed values cross the process boundary as they are (no boolean lost to
flag re-serialisation) and keys never appear on a command line (`ps` shows command lines to every local user).
Flags given on the command line win over the file. Not the slime CLI (`slime.config.arguments`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from slime.engine.config import Config
from slime.engine.server.guard import DEFAULT_MAX_REQUEST_BYTES, AccessPolicy

# SGLang launch-flag spellings accepted as aliases of Config fields, so scripts written for SGLang keep working.
SGLANG_ALIASES = {
    "max_num_seqs": ["--max-running-requests"],
    "max_num_batched_tokens": ["--chunked-prefill-size"],
    "max_model_len": ["--context-length"],
    "kvcache_block_size": ["--page-size"],
    "gpu_memory_utilization": ["--mem-fraction-static"],
    "seed": ["--random-seed"],
}
POLICY_FIELDS = ("api_key", "admin_api_key", "allow_remote_admin", "max_request_bytes")  # AccessPolicy's
SERVER_FIELDS = (*POLICY_FIELDS, "weights_dir_allowlist")


@dataclass
class ServerSettings:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    log_level: str = "warning"
    engine: dict = field(default_factory=dict)
    policy: AccessPolicy = field(default_factory=AccessPolicy)
    weights_dir_allowlist: list[str] = field(default_factory=list)

    def allowed_weight_dirs(self) -> list[Path]:
        """Folders /update_weights_from_disk and /pull_weights may use: the allowlist, or by default the
        checkpoint's parent."""
        dirs = self.weights_dir_allowlist or [str(Path(self.model_path).resolve().parent)]
        return [Path(d).resolve() for d in dirs]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="SGLang-compatible HTTP server for slime's built-in engine")
    parser.add_argument("--model-path", default=None, help="Hugging Face checkpoint directory")
    parser.add_argument("--config-file", default=None,
                        help="JSON file with model_path, engine (Config fields) and server settings; flags win")
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 30000)")
    parser.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: model path)")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    access = parser.add_argument_group("access (slime.engine.server.guard)")
    access.add_argument("--api-key", default=None, help="bearer token every route but /health requires")
    access.add_argument("--admin-api-key", default=None,
                        help="bearer token the routes that change weights or state require (default: --api-key)")
    access.add_argument("--allow-remote-admin", action="store_true", default=None,
                        help="serve the admin routes to peers that are not on loopback")
    access.add_argument("--max-request-bytes", type=int, default=None,
                        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    access.add_argument("--weights-dir-allowlist", action="append", default=None, metavar="DIR",
                        help="folder /update_weights_from_disk and /pull_weights may read and /pull_weights may "
                             "write (repeatable; default: the parent of --model-path)")
    engine_group = parser.add_argument_group("engine (slime.engine.config.Config fields)")
    for config_field in fields(Config):
        if config_field.name == "model":
            continue
        flags = ["--" + config_field.name.replace("_", "-")] + SGLANG_ALIASES.get(config_field.name, [])
        kind = str(config_field.type)
        if "bool" in kind:
            engine_group.add_argument(*flags, dest=config_field.name, action=argparse.BooleanOptionalAction,
                                      default=None)
        else:
            parse = int if "int" in kind else float if "float" in kind else str
            engine_group.add_argument(*flags, dest=config_field.name, type=parse, default=None)
    return parser


def write_config_file(path: str | Path, model_path: str, engine: dict, server: dict) -> Path:
    """Write a --config-file readable by its owner only (it may hold API keys)."""
    unknown = sorted(set(server) - set(SERVER_FIELDS))
    if unknown:
        raise ValueError(f"unknown engine server setting(s) {unknown}; known: {list(SERVER_FIELDS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump({"model_path": model_path, "engine": engine, "server": server}, file, indent=1)
    return path


def parse_settings(argv: list[str] | None = None) -> ServerSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    loaded = {"engine": {}, "server": {}}
    if args.config_file:
        try:
            loaded = {**loaded, **json.loads(Path(args.config_file).read_text())}
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"--config-file {args.config_file}: {error}")
    unknown_engine = sorted(set(loaded["engine"]) - set(Config.field_names()) - {"model"})
    unknown_server = sorted(set(loaded["server"]) - set(SERVER_FIELDS))
    if unknown_engine or unknown_server:
        parser.error(f"--config-file {args.config_file}: unknown field(s) {unknown_engine + unknown_server}")
    engine = dict(loaded["engine"])
    engine.update({f.name: getattr(args, f.name) for f in fields(Config)
                   if f.name != "model" and getattr(args, f.name) is not None})
    server = dict(loaded["server"])
    server.update({name: getattr(args, name) for name in SERVER_FIELDS if getattr(args, name) is not None})
    model_path = args.model_path or loaded.get("model_path")
    if not model_path:
        parser.error("--model-path is required (or model_path in --config-file)")
    try:
        policy = AccessPolicy(**{k: server[k] for k in POLICY_FIELDS if k in server})
    except ValueError as error:
        parser.error(str(error))
    return ServerSettings(
        model_path=model_path,
        host=args.host or loaded.get("host") or "127.0.0.1",
        port=args.port or loaded.get("port") or 30000,
        served_model_name=args.served_model_name,
        log_level=args.log_level or loaded.get("log_level") or "warning",
        engine=engine,
        policy=policy,
        weights_dir_allowlist=list(server.get("weights_dir_allowlist") or []),
    )
