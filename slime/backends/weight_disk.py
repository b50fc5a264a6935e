"""Disk weight sync, the writing side (`--update-weight-transport disk`): rank 0 writes each weight push as a
version folder `weight_v{N:06d}/` under `--update-weight-disk-dir` (format: slime.utils.weight_delta), bucket by
bucket as the backend's gathers yield them, into `weight_v{N:06d}.tmp/` renamed into place when complete, so a
reader never sees half a version.

- full (`--update-weight-mode full`): an HF checkpoint (safetensors in the push dtype, config.json and the
  tokenizer files of --hf-checkpoint).
- delta (`--update-weight-mode delta`): only the bytes that changed since the previous push, encoded by
  `--update-weight-delta-encoding` with `--update-weight-delta-checksum` checksums of the new bytes. The writer
  keeps the last pushed bytes of every weight on the host. The first push after `reset()` (a new set of engines)
  is a full version: the engines' local checkpoints then start from exactly those bytes, whatever checkpoint or
  dtype they were started with. `rewrite_full()` writes the current version again as a full one, from those
  bytes (the fall-back when an engine could not apply a delta).

Not the HTTP side (slime.backends.weight_sender tells the engines to load a version) and not the engine's reader.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slime.backends.checkpoint_files import copy_hf_extra_files
from slime.utils import weight_delta


@dataclass
class DiskSync:
    """What a disk weight push needs besides the writer: whether to keep each version folder after the engines
    loaded it, the engines' host-local checkpoint (pulled into before loading; None: they load the version folder
    itself), and `post_write(version_dir, engine_urls)` (--custom-update-weight-post-write-path, or None)."""
    writer: DiskWeightWriter
    keep_files: bool
    local_checkpoint_dir: str | None
    post_write: Callable[[str, list[str]], None] | None


def disk_sync_from_args(args) -> DiskSync | None:
    """The run's disk sync settings, or None unless --update-weight-transport disk."""
    if args.update_weight_transport != "disk":
        return None
    from slime.utils.misc import load_function

    hook_path = args.custom_update_weight_post_write_path
    hook = load_function(hook_path, "--custom-update-weight-post-write-path") if hook_path else None

    def post_write(version_folder: str, engine_urls: list[str]) -> None:
        hook(args, version_folder, engine_urls)  # slime's signature; the engines as their URLs

    delta_encoding = args.update_weight_delta_encoding if args.update_weight_mode == "delta" else None
    writer = DiskWeightWriter(args.update_weight_disk_dir, args.hf_checkpoint, delta_encoding,
                              args.update_weight_delta_checksum)
    return DiskSync(writer, args.update_weight_disk_keep_files, args.update_weight_local_checkpoint_dir,
                    post_write if hook else None)


class DiskWeightWriter:
    def __init__(self, disk_dir: str, hf_checkpoint: str, delta_encoding: str | None, checksum: str):
        """`delta_encoding` None: full versions only."""
        self.disk_dir, self.hf_checkpoint = Path(disk_dir), Path(hf_checkpoint)
        self.delta_encoding, self.checksum = delta_encoding, checksum
        self.last_pushed: dict[str, np.ndarray] = {}  # delta mode: each weight's bytes as last pushed
        self.layouts: dict[str, tuple[torch.dtype, tuple]] = {}
        self.version: int | None = None
        self.is_delta = False
        self.stats = {}

    def reset(self) -> None:
        """Forget the pushed bytes: the next version is a full one."""
        self.last_pushed.clear()
        self.layouts.clear()

    # ---- one version ---------------------------------------------------------------------------------------
    def begin(self, version: int) -> None:
        self.version = version
        self.is_delta = self.delta_encoding is not None and bool(self.last_pushed)
        self.tmp = self._fresh_tmp()
        self.weight_map: dict[str, str] = {}
        self.num_files = 0
        self.stats = {"total_bytes": 0, "changed_bytes": 0, "wire_bytes": 0}

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Write one bucket's weights (their full values, or in a delta version those that changed)."""
        tensors, checksums = {}, {}
        for name, tensor in bucket:
            aliases_source = tensor.device.type == "cpu"  # .cpu() of a host tensor is the live tensor itself
            tensor = tensor.detach().cpu().contiguous()
            new = tensor.view(torch.uint8).reshape(-1).numpy()
            self.stats["total_bytes"] += new.size
            if self.is_delta:
                if name not in self.last_pushed or self.layouts[name] != (tensor.dtype, tuple(tensor.shape)):
                    raise RuntimeError(f"delta weight sync: {name!r} was not in the previous push with this "
                                       "dtype and shape (the pushed weights must be the same set each time)")
                encoded, num_changed = weight_delta.encode(self.delta_encoding, self.last_pushed[name], new)
                self.stats["changed_bytes"] += num_changed
                if encoded is not None:
                    tensors[name] = torch.from_numpy(encoded)
                    checksums[name] = weight_delta.checksum(self.checksum, new)
            else:
                tensors[name] = tensor
                self.stats["changed_bytes"] += new.size
            if self.delta_encoding is not None:
                self.last_pushed[name] = new.copy() if aliases_source else new
                self.layouts[name] = (tensor.dtype, tuple(tensor.shape))
        if tensors:
            self._write_file(tensors, checksums if self.is_delta else {"format": "pt"})

    def finish(self) -> Path:
        """Write the index (and a full version's config and tokenizer files), then publish the folder."""
        metadata = {"version": f"{self.version:06d}", "total_size": self.stats["wire_bytes"]}
        if self.is_delta:
            metadata.update(base_version=f"{self.version - 1:06d}", delta_encoding=self.delta_encoding,
                            compression_format=weight_delta.COMPRESSION, checksum_format=self.checksum)
        else:
            copy_hf_extra_files(self.hf_checkpoint, self.tmp)
        index = {"metadata": metadata, "weight_map": self.weight_map}
        (self.tmp / weight_delta.INDEX_FILE).write_text(json.dumps(index, indent=1))
        final = weight_delta.version_dir(self.disk_dir, self.version)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self.tmp, final)
        return final

    def rewrite_full(self) -> Path:
        """Publish the current version again, as a full one, from the bytes just pushed (delta mode)."""
        self.is_delta = False
        self.tmp = self._fresh_tmp()
        self.weight_map = {}
        self.num_files = 0
        self.stats["wire_bytes"] = 0
        tensors = {name: torch.from_numpy(data).view(dtype).reshape(shape)  # save_file only reads them
                   for name, data in self.last_pushed.items() for dtype, shape in [self.layouts[name]]}
        if tensors:
            self._write_file(tensors, {"format": "pt"})
        return self.finish()

    def _fresh_tmp(self) -> Path:
        tmp = weight_delta.version_dir(self.disk_dir, self.version).with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def _write_file(self, tensors: dict, metadata: dict) -> None:
        from safetensors.torch import save_file

        file_name = f"model-{self.num_files:05d}.safetensors"
        self.num_files += 1
        save_file(tensors, str(self.tmp / file_name), metadata=metadata)
        self.weight_map.update({name: file_name for name in tensors})
        self.stats["wire_bytes"] += (self.tmp / file_name).stat().st_size
