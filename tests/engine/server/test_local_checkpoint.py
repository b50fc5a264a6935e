"""The disk weight-sync format (slime.utils.weight_delta) and the engine's local checkpoint that deltas apply to
(slime.engine.server.local_checkpoint), on real safetensors folders written by the trainer's DiskWeightWriter."""

import json

import numpy as np
import pytest
import torch

from slime.backends.weight_disk import DiskWeightWriter
from slime.engine.server import local_checkpoint
from slime.utils import weight_delta


def _sparse_change(rng, size, num_changed):
    old = rng.integers(0, 256, size, dtype=np.uint8)
    new = old.copy()
    positions = rng.choice(size, num_changed, replace=False)
    new[positions] ^= rng.integers(1, 256, num_changed, dtype=np.uint8)  # every chosen byte really changes
    return old, new


@pytest.mark.parametrize("encoding", weight_delta.DELTA_ENCODINGS)
def test_encode_apply_round_trip_and_only_changes_travel(encoding):
    rng = np.random.default_rng(0)
    old, new = _sparse_change(rng, 1 << 16, 64)
    encoded, num_changed = weight_delta.encode(encoding, old, new)
    assert num_changed == 64
    assert encoded.size < 2000  # 64 changed bytes of 65536: the delta is a small fraction of the tensor
    region = old.copy()
    weight_delta.apply(encoding, region, encoded.tobytes())
    assert np.array_equal(region, new)
    weight_delta.apply(encoding, region, encoded.tobytes())
    # xor is an involution (applied twice it reverts); overwrite is idempotent.
    assert np.array_equal(region, old if encoding == "xor" else new)
    assert weight_delta.encode(encoding, new, new) == (None, 0)


def test_checksums_match_published_test_vectors():
    assert weight_delta.checksum("xxh3-128", b"") == "99aa06d3014798d86001c324468d497f"  # XXH3_128bits("")
    assert weight_delta.checksum("adler32", b"Wikipedia") == "11e60398"
    data = np.frombuffer(b"Wikipedia", dtype=np.uint8)
    assert weight_delta.checksum("adler32", data) == "11e60398"  # arrays hash as their bytes
    with pytest.raises(ValueError, match="unknown checksum"):
        weight_delta.checksum("md5", b"")


def _weights(seed):
    generator = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=generator), "b.bias": torch.randn(16, generator=generator),
            "c.weight": torch.randn(8, 8, generator=generator).to(torch.bfloat16)}


def _publish(writer, version, weights):
    writer.begin(version)
    items = list(weights.items())
    writer.add(items[:2])
    writer.add(items[2:])
    return writer.finish()


def _read(folder):
    from safetensors.torch import load_file

    out = {}
    for file in folder.glob("*.safetensors"):
        out.update(load_file(file))
    return out


def test_pull_follows_the_chain_from_the_newest_full_version(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    writer = DiskWeightWriter(str(tmp_path / "pushes"), str(hf), "xor", "xxh3-128")
    weights = _weights(0)
    _publish(writer, 1, weights)  # full: nothing pushed before
    pushed = {}
    for version in (2, 3):
        weights = dict(weights)
        weights["a.weight"] = weights["a.weight"].clone()
        weights["a.weight"][version] += 1.0  # one row changes; b and c stay
        folder = _publish(writer, version, weights)
        index = weight_delta.read_index(folder)
        assert index["metadata"]["delta_encoding"] == "xor" and set(index["weight_map"]) == {"a.weight"}
        pushed[version] = weights
    local = tmp_path / "local"
    local_checkpoint.pull(local, hf, tmp_path / "pushes", 3)  # fresh host: full v1, then deltas 2 and 3
    pulled = _read(local)
    assert all(torch.equal(pulled[k], weights[k]) for k in weights) and pulled["c.weight"].dtype == torch.bfloat16
    assert local_checkpoint.applied_version(local) == 3 and (local / "config.json").is_file()
    local_checkpoint.pull(local, hf, tmp_path / "pushes", 3)  # a second engine of the host: nothing to do
    # An older version (a resumed run): back to full version 1, then delta 2.
    local_checkpoint.pull(local, hf, tmp_path / "pushes", 2)
    assert torch.equal(_read(local)["a.weight"], pushed[2]["a.weight"]) and local_checkpoint.applied_version(local) == 2
    assert not torch.equal(pushed[2]["a.weight"], pushed[3]["a.weight"])


def test_pull_seeds_version_zero_from_the_engines_checkpoint_and_checks_order(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    base = _weights(1)
    save_file(base, str(hf / "model.safetensors"))
    writer = DiskWeightWriter(str(tmp_path / "pushes"), str(hf), "overwrite", "adler32")
    writer.last_pushed = {k: v.view(torch.uint8).reshape(-1).numpy().copy() for k, v in base.items()}
    writer.layouts = {k: (v.dtype, tuple(v.shape)) for k, v in base.items()}  # as if v0 had been pushed
    new = dict(base, **{"b.bias": base["b.bias"] * 2})
    _publish(writer, 1, new)
    local = tmp_path / "local"
    local_checkpoint.pull(local, hf, tmp_path / "pushes", 1)  # v0 = the engine's own checkpoint, then delta 1
    assert torch.equal(_read(local)["b.bias"], new["b.bias"])
    marker = local / local_checkpoint.SYNC_DIR / "state.json"
    marker.write_text(json.dumps({"version": "000005"}))
    _publish(writer, 6, dict(new, **{"b.bias": new["b.bias"] + 1}))
    marker.write_text(json.dumps({"version": "000004"}))  # the delta builds on 5, this copy holds 4
    with pytest.raises(FileNotFoundError, match="published weight version missing: .*weight_v000005"):
        local_checkpoint.pull(local, hf, tmp_path / "pushes", 6)  # 5 would be needed first, and is not there
    with pytest.raises(ValueError, match="builds on version 5, the local checkpoint holds 4"):
        local_checkpoint._apply_delta(local, weight_delta.version_dir(tmp_path / "pushes", 6))
