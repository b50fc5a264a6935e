"""slime's weight-sync and external-engine flags: the rules between them (slime's own, with its messages' substance)
and what they derive, at parse time (no engine starts)."""

import json
from pathlib import Path

import pytest

from slime.config.arguments import parse_args
from slime.ray.engine_actor import engine_server_command
from tests.config.test_flag_status import base  # noqa: F401  (the fixture: a minimal run's flags over a config-only model)


@pytest.mark.parametrize("extra,message", [
    (["--update-weight-transport", "disk"], "--update-weight-transport disk needs --update-weight-disk-dir"),
    (["--update-weight-mode", "delta"], "--update-weight-mode delta needs --update-weight-transport disk"),
    (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d"],
     "--update-weight-mode delta needs --update-weight-local-checkpoint-dir"),
    (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d",
      "--update-weight-local-checkpoint-dir", "/l", "--colocate"], "--update-weight-mode delta is not for --colocate"),
    (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d",
      "--update-weight-local-checkpoint-dir", "/l", "--update-weight-delta-checksum", "blake3"],
     "needs: pip install blake3"),
    (["--update-weight-local-checkpoint-dir", "/l"], "only used with --update-weight-transport disk"),
    (["--update-weight-disk-keep-files"], "only used with --update-weight-transport disk"),
    (["--custom-update-weight-post-write-path", "json.dumps"], "only used with --update-weight-transport disk"),
    (["--custom-update-weight-post-write-path", "no_such_module.fn", "--update-weight-transport", "disk",
      "--update-weight-disk-dir", "/d"], "--custom-update-weight-post-write-path"),
    (["--rollout-external-engine-addrs", "127.0.0.1:1", "--colocate"], "--colocate"),
    (["--rollout-external-engine-addrs", "127.0.0.1"], "use host:port or http://host:port"),
    (["--rollout-external-engine-addrs", "ftp://127.0.0.1:80"], "use host:port or http://host:port"),
])
def test_weight_sync_rules(base, extra, message):
    with pytest.raises(ValueError, match=message):  # ArgumentError is one
        parse_args(base + extra)


def test_disk_sync_flags_are_accepted_and_open_the_engines_folders(base, tmp_path):
    args = parse_args(base + ["--update-weight-mode", "delta", "--update-weight-transport", "disk",
                              "--update-weight-disk-dir", "/shared/pushes", "--update-weight-local-checkpoint-dir",
                              "/nvme/local", "--update-weight-delta-encoding", "overwrite",
                              "--update-weight-delta-checksum", "adler32", "--update-weight-disk-keep-files"])
    assert (args.update_weight_mode, args.update_weight_delta_encoding) == ("delta", "overwrite")
    engine_server_command(args, 1234, tmp_path / "engine.json")
    server = json.loads((tmp_path / "engine.json").read_text())["server"]
    # The checkpoint's parent (the default it replaces), the published versions, the engines' local checkpoint.
    assert server["weights_dir_allowlist"] == [str(Path(args.hf_checkpoint).resolve().parent), "/shared/pushes",
                                               "/nvme/local"]


def test_external_engine_addrs_derive_the_engines(base):
    args = parse_args(base + ["--rollout-external-engine-addrs", "127.0.0.1:30000", "http://localhost:30001/"])
    assert args.rollout_external is True
    assert args.rollout_external_engine_urls == ["http://127.0.0.1:30000", "http://localhost:30001"]
    assert args.rollout_num_engines == 2 and args.rollout_num_gpus == 0  # no device of this run is theirs
    plain = parse_args(base)
    assert plain.rollout_external is False and plain.rollout_num_engines == 1
