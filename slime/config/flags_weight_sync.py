"""slime's weight-sync, external-engine and placement flags: how new weights reach the engines
(`--update-weight-transport nccl|disk`), engines started outside this run (`--rollout-external-engine-addrs`),
how rollout data reaches the trainer, and the train processes' environment.

Registration only; `validate_args` checks the combinations and `flag_status` lists what cannot apply here.
"""

from __future__ import annotations

import json


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return parsed


def add_weight_sync_arguments(parser):
    g = parser.add_argument_group("weight sync and engines")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2)
    g.add_argument("--update-weights-interval", type=int, default=1)
    g.add_argument("--update-weight-mode", choices=["full", "delta"], default="full",
                   help="delta (with --update-weight-transport disk): write only the bytes that changed since the "
                        "last push, checksum-verified by the engines (docs/concepts/weight-sync.md)")
    g.add_argument("--update-weight-transport", choices=["nccl", "disk"], default="nccl",
                   help="nccl: the trainer sends the weights to the engines (NCCL between GPUs, tensors over HTTP "
                        "on the CPU); disk: it writes a Hugging Face checkpoint under --update-weight-disk-dir and "
                        "each engine reloads it (POST /update_weights_from_disk)")
    g.add_argument("--update-weight-disk-dir", default=None,
                   help="folder shared by trainer and engines for --update-weight-transport disk")
    g.add_argument("--update-weight-disk-keep-files", action="store_true",
                   help="keep every version folder written for disk weight sync (default: each is removed once "
                        "the engines loaded it)")
    g.add_argument("--update-weight-delta-encoding", choices=["xor", "overwrite"], default="xor",
                   help="xor: new ^ old bytes (smallest; applies once); overwrite: changed positions and bytes")
    g.add_argument("--update-weight-delta-checksum", choices=["xxh3-128", "blake3", "adler32"], default="xxh3-128",
                   help="checksum of each changed weight's new bytes, checked by the engines (blake3: pip install "
                        "blake3)")
    g.add_argument("--update-weight-local-checkpoint-dir", default=None,
                   help="the engines' host-local checkpoint: each pulls every version into it (POST /pull_weights) "
                        "and loads it from there; required by --update-weight-mode delta")
    g.add_argument("--custom-update-weight-post-write-path", default=None, metavar="MODULE.FN",
                   help="fn(args, version_dir, engine_urls), called once a disk version is written, before the "
                        "engines read it")
    g.add_argument("--rollout-external-engine-addrs", nargs="+", default=None, metavar="HOST:PORT",
                   help="engines started outside this run (host:port or http://host:port): registered with the "
                        "router, health-checked and weight-synced, never started or stopped by the run")
    g.add_argument("--rollout-data-transport", choices=["object-store", "nixl"], default="object-store")
    g.add_argument("--release-train", action="store_true",
                   help="end the Megatron train processes after each weight push (all their memory goes back) and "
                        "start them again from the latest --save checkpoint before the next train step; needs "
                        "--update-weight-transport disk and saves every rollout")
    g.add_argument("--train-env-vars", type=_json_object, default={},
                   help='JSON object of extra environment variables for the train processes, e.g. '
                        '\'{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}\'')
    g.add_argument("--qwen-gdn-backend", choices=["fla", "flashqla"], default="fla")
