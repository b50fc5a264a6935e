"""Disk weight sync (`--update-weight-transport disk`, full and `--update-weight-mode delta`) from the in-process
FSDP trainer into a REAL engine server process, through real safetensors folders on disk.

The engine (on the CPU; with the `gpu` case the trainer is on CUDA: disk sync needs no common device) starts from
a checkpoint of another seed, so it disagrees with the trainer in every weight until a push
lands. "Bit-identical" is checked two ways: the engine's local checkpoint (what it loaded) equals the trainer's
weights byte for byte, and the engine's log-probs of a fixed request equal, exactly, those it gives after loading a
checkpoint written here straight from the trainer's weights; they also match transformers' log-probs under the
trainer's weights within 1e-4.
"""

import json
import logging
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from slime.engine.server.launch import launch_server
from slime.utils import weight_delta
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer

PROMPT = list(range(3, 40))
SAMPLING = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_sync")
    return {"engine": build_tiny_model(root / "engine", arch="qwen3", seed=11),
            "trainer": build_tiny_model(root / "trainer", arch="qwen3", seed=12),
            "root": root}


@pytest.fixture(scope="module")
def engine(folders):
    server = launch_server(folders["engine"], extra_args=["--device", "cpu", "--weights-dir-allowlist",
                                                          str(folders["root"])],
                           log_path=folders["root"] / "engine.log", env={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()


def _post(url, path, payload, status=200):
    response = httpx.post(url + path, json=payload, timeout=120, trust_env=False)
    assert response.status_code == status, response.text
    return response.json()


def _engine_log_probs(url):
    """(log-prob, token) pairs of a fixed request, from an empty prefix cache (so each call computes alike)."""
    assert httpx.post(url + "/flush_cache", timeout=60, trust_env=False).status_code == 200
    meta = _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": SAMPLING})
    return [(lp, t) for lp, t, _ in meta["meta_info"]["output_token_logprobs"]], meta["meta_info"]["weight_version"]


def _trainer_weights(trainer):
    return {name.removeprefix("hf_model."): value.cpu() for name, value in full_params(trainer).items()}


def _folder_tensors(folder):
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_engine_holds(url, folders, weights):
    """The engine computes exactly what it computes from a checkpoint of `weights`, and what transformers does."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    synced, _ = _engine_log_probs(url)
    reference = folders["root"] / "reference"  # inside the engine's --weights-dir-allowlist
    reference.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(reference / "model.safetensors"))
    (reference / "config.json").write_text((folders["trainer"] / "config.json").read_text())
    _post(url, "/update_weights_from_disk", {"model_path": str(reference), "weight_version": "reference"})
    assert _engine_log_probs(url)[0] == synced
    model = AutoModelForCausalLM.from_pretrained(folders["trainer"], dtype=torch.float32).eval()
    tokens = PROMPT + [t for _, t in synced]
    with torch.no_grad():
        logits = torch.func.functional_call(model, weights, (torch.tensor([tokens]),)).logits[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    expected = [log_probs[len(PROMPT) + i - 1, t].item() for i, (_, t) in enumerate(synced)]
    np.testing.assert_allclose([lp for lp, _ in synced], expected, rtol=0, atol=1e-4)


def _disk_trainer(folders, tmp_path, *extra, device="cpu"):
    args = make_args(folders["trainer"], "--lr", "1e-2", "--update-weight-buffer-size", "30000",
                     "--update-weight-transport", "disk", "--update-weight-disk-dir", str(folders["root"] / "pushes"),
                     *extra, device=device)
    return make_trainer(args)


def test_full_disk_sync_loads_the_trainers_weights(engine, folders, tmp_path):
    _post(engine.url, "/update_weights_from_disk", {"model_path": str(folders["engine"]), "weight_version": "0"})
    before, _ = _engine_log_probs(engine.url)
    trainer = _disk_trainer(folders, tmp_path, "--update-weight-disk-keep-files")
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    result = trainer.update_weights([engine.url], weight_version="3", mode="disk")

    folder = folders["root"] / "pushes" / "weight_v000003"
    assert result.num_buckets > 2 and result.unreachable_engines == []
    written = _folder_tensors(folder)
    weights = _trainer_weights(trainer)
    assert sorted(written) == sorted(weights) and all(torch.equal(written[k], weights[k]) for k in weights)
    assert len(list(folder.glob("*.safetensors"))) == result.num_buckets  # one file per bucket
    assert (folder / "config.json").is_file() and not folder.with_suffix(".tmp").exists()
    assert "delta_encoding" not in weight_delta.read_index(folder)["metadata"]
    assert result.metrics["perf/update_weights_density"] == 1.0
    synced, version = _engine_log_probs(engine.url)
    assert version == "3" and synced != before
    _assert_engine_holds(engine.url, folders, weights)


POST_WRITE_CALLS = []


def record_post_write(args, version_dir, engine_urls):
    """A --custom-update-weight-post-write-path hook: what it was given and what the folder held then."""
    POST_WRITE_CALLS.append((version_dir, list(engine_urls), sorted(p.name for p in Path(version_dir).iterdir())))


def test_full_disk_sync_removes_the_folder_and_runs_the_post_write_hook(engine, folders, tmp_path):
    calls = POST_WRITE_CALLS
    trainer = _disk_trainer(folders, tmp_path, "--custom-update-weight-post-write-path",
                            f"{__name__}.record_post_write")
    trainer.update_weights([engine.url], weight_version="4", mode="disk")
    folder = folders["root"] / "pushes" / "weight_v000004"
    assert not folder.exists()  # loaded, then removed (no --update-weight-disk-keep-files)
    assert len(calls) == 1 and calls[0][0] == str(folder) and calls[0][1] == [engine.url]
    assert "config.json" in calls[0][2] and weight_delta.INDEX_FILE in calls[0][2]  # complete when the hook runs
    assert _engine_log_probs(engine.url)[1] == "4"
    with pytest.raises(ValueError, match="integer weight version"):
        trainer.update_weights([engine.url], weight_version="v5", mode="disk")


def _changed_bytes(old: dict, new: dict) -> int:
    return sum(int((old[k].view(torch.uint8) != new[k].view(torch.uint8)).sum()) for k in new)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_delta_syncs_keep_the_engine_bit_identical(engine, folders, tmp_path, device):
    local = folders["root"] / "local_delta"
    trainer = _disk_trainer(folders, tmp_path, "--update-weight-mode", "delta", "--update-weight-disk-keep-files",
                            "--update-weight-local-checkpoint-dir", str(local), device=device)
    pushes = folders["root"] / "pushes"
    previous = None
    for version in range(10, 14):
        if version != 12:  # version 12: nothing trained, nothing changed
            trainer.train(version, make_train_data(4, vocab_size=300, seed=version))
        weights = _trainer_weights(trainer)
        result = trainer.update_weights([engine.url], weight_version=str(version), mode="disk")
        folder = pushes / f"weight_v{version:06d}"
        metadata = weight_delta.read_index(folder)["metadata"]
        density = result.metrics["perf/update_weights_density"]
        if previous is None:  # the first push to these engines is a full version
            assert "delta_encoding" not in metadata and density == 1.0
        else:
            assert metadata["delta_encoding"] == "xor" and metadata["checksum_format"] == "xxh3-128"
            assert metadata["base_version"] == f"{version - 1:06d}"
            total = sum(v.numel() * v.element_size() for v in weights.values())
            assert density == _changed_bytes(previous, weights) / total  # exactly the bytes that changed
            changed_names = {k for k in weights if not torch.equal(previous[k], weights[k])}
            assert set(weight_delta.read_index(folder)["weight_map"]) == changed_names  # only those travel
            if version == 12:
                assert density == 0 and not changed_names
        local_tensors = _folder_tensors(local)
        assert all(torch.equal(local_tensors[k], weights[k]) for k in weights)
        assert _engine_log_probs(engine.url)[1] == str(version)
        previous = weights
    _assert_engine_holds(engine.url, folders, previous)


def test_checksum_mismatch_falls_back_to_a_full_sync(engine, folders, tmp_path, caplog):
    local = folders["root"] / "local_mismatch"
    trainer = _disk_trainer(folders, tmp_path, "--update-weight-mode", "delta", "--update-weight-disk-keep-files",
                            "--update-weight-delta-checksum", "adler32",
                            "--update-weight-local-checkpoint-dir", str(local))
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    trainer.update_weights([engine.url], weight_version="20", mode="disk")
    # The engine host's copy goes bad: one byte of a weight the next step changes.
    name = "model.layers.0.self_attn.q_proj.weight"
    path, offset, _ = weight_delta.tensor_locations(local)[name]
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    before = _trainer_weights(trainer)
    trainer.train(1, make_train_data(4, vocab_size=300, seed=2))
    weights = _trainer_weights(trainer)
    assert not torch.equal(before[name], weights[name])
    with caplog.at_level(logging.ERROR, logger="slime.backends.weight_sender"):
        trainer.update_weights([engine.url], weight_version="21", mode="disk")
    assert "checksum mismatch" in caplog.text and "falling back to a full sync" in caplog.text
    folder = folders["root"] / "pushes" / "weight_v000021"
    assert "delta_encoding" not in weight_delta.read_index(folder)["metadata"]  # written again, as a full version
    local_tensors = _folder_tensors(local)
    assert all(torch.equal(local_tensors[k], weights[k]) for k in weights)
    assert _engine_log_probs(engine.url)[1] == "21"
    _assert_engine_holds(engine.url, folders, weights)


def test_pull_weights_rejects_folders_outside_the_allowlist(engine, folders, tmp_path):
    answer = _post(engine.url, "/pull_weights", {"local_checkpoint_dir": str(tmp_path / "elsewhere"),
                                                  "source_dir": str(folders["root"]), "target_version": 1}, 400)
    assert "local_checkpoint_dir" in answer["message"] and "--weights-dir-allowlist" in answer["message"]
    answer = _post(engine.url, "/pull_weights", {"local_checkpoint_dir": str(folders["root"] / "l"),
                                                  "source_dir": str(folders["root"] / "missing"),
                                                  "target_version": 2}, 400)
    assert "published weight version missing" in answer["message"] and answer["success"] is False
    answer = _post(engine.url, "/pull_weights", {"local_checkpoint_dir": str(folders["root"]),
                                                  "source_dir": str(folders["root"]), "target_version": 0}, 400)
    assert "holds the served checkpoint" in answer["message"]  # a pull would overwrite the engine's own files


def _megatron_delta_pushes(rank, world_size, port, checkpoint, pushes, local, engine_url):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel
    from tests.helpers.megatron_helpers import make_megatron_args

    args = make_megatron_args(checkpoint, "--lr", "1e-2", "--update-weight-buffer-size", "30000",
                              "--update-weight-transport", "disk", "--update-weight-disk-dir", pushes,
                              "--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", local,
                              world_size=world_size, tp=2)
    trainer = make_trainer(args, rank, world_size, port)
    results = []
    for version in (30, 31):
        trainer.train(version, make_train_data(4, vocab_size=300, seed=version))
        results.append(trainer.update_weights([engine_url], weight_version=str(version), mode="disk"))
    weights = dict(trainer.backend.hf_weights(None))  # collective: every rank gathers, rank 0 keeps the result
    destroy_model_parallel()
    return results, weights if rank == 0 else None


@pytest.mark.slow  # ~60-100 s on 2 cores (two Megatron processes); the FSDP cases above cover the format unmarked
def test_megatron_tp2_delta_pushes_reach_the_engine(engine, folders):
    """The Megatron backend at TP=2 (two gloo processes): both ranks take part in the gathers, rank 0 writes."""
    pytest.importorskip("megatron.core")
    from tests.helpers.fsdp_helpers import run_distributed

    local = folders["root"] / "local_megatron"
    (results, weights), _ = run_distributed(_megatron_delta_pushes, 2, folders["trainer"],
                                            str(folders["root"] / "pushes"), str(local), engine.url)
    assert results[0].metrics["perf/update_weights_density"] == 1.0  # the first push: a full version
    assert 0 < results[1].metrics["perf/update_weights_density"] <= 1.0
    local_tensors = _folder_tensors(local)
    assert sorted(local_tensors) == sorted(weights)
    assert all(torch.equal(local_tensors[k], weights[k].to(local_tensors[k].dtype)) for k in weights)
    assert _engine_log_probs(engine.url)[1] == "31"
    _assert_engine_holds(engine.url, folders, {k: local_tensors[k] for k in weights})


@pytest.mark.slow  # a train.py run (~60-120 s on 2 cores); test_external_engines.py runs disk deltas end to end
def test_grpo_run_with_its_own_engine_syncs_over_disk(tmp_path):
    """The run's own engine gets the disk folders in its allowlist and serves the pushed weights (its log-probs are
    the trainer's after the push between the two rollouts)."""
    import subprocess
    import sys

    from examples.quickstart.task import build_task

    task = build_task(tmp_path / "task", seed=0)
    out = tmp_path / "run"
    argv = ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "2", "--rollout-max-response-len", "4", "--lr", "1e-3",
            "--update-weight-transport", "disk", "--update-weight-disk-dir",
            str(tmp_path / "pushes"), "--output-dir", str(out), "--no-progress"]
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(repo / "train.py"), *argv], cwd=repo, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["perf/update_weights_density"] for r in rows] == [1.0, 1.0]  # full versions
    assert rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert not list((tmp_path / "pushes").iterdir())
