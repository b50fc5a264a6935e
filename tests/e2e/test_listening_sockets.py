"""A local run (no --ray-address) listens on loopback only: every socket of every process of a short real
train.py run (Ray's GCS, raylet, workers and agents, the trainer ranks and their gloo group, the engine server,
the sglang-router) is bound to 127.0.0.1 or ::1 (docs/guides/security.md, "What listens where")."""

import pytest

from tests.helpers.run_processes import is_loopback, kill_leftovers, small_grpo_argv, start_run, wait_gone, watch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


def test_local_run_listens_on_loopback_only(task, tmp_path):
    log_path = tmp_path / "train.log"
    process = start_run(small_grpo_argv(task, tmp_path / "run", "--rm-type", "math"), log_path)
    watched = watch(process, timeout=400)
    try:
        assert process.wait(timeout=60) == 0, log_path.read_text()[-6000:]
        listeners = list(watched.listeners.values())
        commands = " ".join(listener.cmdline for listener in listeners)
        # The sampler saw the run's servers, so an empty or partial view cannot pass.
        for server in ("gcs_server", "raylet", "slime.engine.server", "ray::TrainRayActor", "sglang::router"):
            assert server in commands, (server, [(lst.ip, lst.port, lst.cmdline) for lst in listeners])
        exposed = [(lst.kind, lst.ip, lst.port, lst.cmdline) for lst in listeners if not is_loopback(lst.ip)]
        assert exposed == [], exposed
        assert "listens beyond loopback" not in log_path.read_text()  # no library needed an exception
    finally:
        kill_leftovers(watched)
        wait_gone(watched, timeout=10)
