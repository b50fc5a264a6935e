"""`--rollout-external-engine-addrs`: train.py runs on an engine server it did not start (a real
`python -m slime.engine.server` process started by the test on 127.0.0.1), registers it with its router, syncs
weights into it over disk deltas (sft_loss, so that the step surely changes weights), and leaves it running; the
engine watch ends a run whose external engine goes away; a run whose external engine does not answer at the start
stops with an error naming it."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from slime.engine.server import local_checkpoint
from slime.engine.server.launch import launch_server
from slime.utils.misc import find_free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def _argv(task, out: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-max-response-len", "4", "--lr", "1e-3",
            "--output-dir", str(out), "--no-progress", *extra]


def _train(argv, timeout=600):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_run_uses_an_external_engine_with_delta_disk_sync(task, tmp_path):
    shared = tmp_path / "shared"
    engine = launch_server(task["model"], extra_args=["--device", "cpu", "--weights-dir-allowlist", str(shared)],
                           log_path=tmp_path / "external_engine.log")
    try:
        out = tmp_path / "run"
        result = _train(_argv(task, out, "--rollout-external-engine-addrs", engine.url.removeprefix("http://"),
                              "--update-weight-mode", "delta", "--update-weight-transport", "disk",
                              "--update-weight-disk-dir", str(shared / "pushes"),
                              "--update-weight-local-checkpoint-dir", str(shared / "local"),
                              "--loss-type", "sft_loss", "--save", str(tmp_path / "ckpt"),
                              "--actor-num-gpus-per-node", "2"))  # two FSDP ranks: both gather, rank 0 writes
        assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-6000:]}"
        assert engine.process.poll() is None  # the run left the engine it did not start running
        assert not list(out.glob("engine_*"))  # and started none of its own
        version = httpx.get(engine.url + "/get_weight_version", timeout=30, trust_env=False).json()
        assert version["weight_version"] == "1"  # the initial push (0, full), then a delta after the rollout
        assert local_checkpoint.applied_version(shared / "local") == 1
        assert not list((shared / "pushes").iterdir())  # each version removed once loaded
        (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert 0 < row["perf/update_weights_density"] < 1  # a delta: the step changed some bytes, not all
        full_size = sum(file.stat().st_size for file in task["model"].glob("*.safetensors"))
        assert 0 < row["perf/update_weights_wire_bytes"] < full_size
        # What the engine loaded is, byte for byte, what the trainer saved after its step.
        from safetensors.torch import load_file

        from slime.utils.checkpoint_state import latest_checkpoint

        saved = load_file(latest_checkpoint(tmp_path / "ckpt") / "model.safetensors")
        engine_copy = {}
        for file in (shared / "local").glob("*.safetensors"):
            engine_copy.update(load_file(file))
        assert saved and all(torch.equal(engine_copy[name], tensor) for name, tensor in saved.items())
        _check_the_watch_ends_the_run_when_it_goes(task, tmp_path, engine)
    finally:
        engine.stop()


def _check_the_watch_ends_the_run_when_it_goes(task, tmp_path, engine):
    """The engine watch of a run on `engine` (alive) reports nothing; once it is gone, it ends the run."""
    import time

    from slime.config.arguments import parse_args
    from slime.ray.engine_failures import EngineFailureError
    from slime.ray.engine_health import EngineSupervisor

    args = parse_args(_argv(task, tmp_path / "watch", "--rollout-external-engine-addrs",
                            engine.url.removeprefix("http://"), "--use-fault-tolerance"))
    supervisor = EngineSupervisor(args, [None], [engine.url], router_url="http://127.0.0.1:9")
    try:
        time.sleep(1.5)  # a few watch rounds while it answers
        supervisor.check()
        assert supervisor.live_urls() == [engine.url]
        engine.stop()
        deadline = time.monotonic() + 30
        while supervisor.fatal is None and time.monotonic() < deadline:
            time.sleep(0.2)
        # Even with --use-fault-tolerance: the run did not start it, so it does not restart it.
        with pytest.raises(EngineFailureError, match=f"external rollout engine 0 \\({engine.url}.*GET /health failed"):
            supervisor.check()
        assert supervisor.num_restarts == 0
    finally:
        supervisor.shutdown()


def test_run_stops_when_an_external_engine_does_not_answer(task, tmp_path, monkeypatch):
    monkeypatch.setattr("slime.ray.external_engines.CONNECT_WAIT_S", 0)
    port = find_free_port()
    from slime.config.arguments import parse_args
    from slime.ray.external_engines import connect_external_engines

    args = parse_args(_argv(task, tmp_path / "run", "--rollout-external-engine-addrs", f"127.0.0.1:{port}"))
    with pytest.raises(RuntimeError, match=f"no engine answers at http://127.0.0.1:{port}.*start it first"):
        connect_external_engines(args)

