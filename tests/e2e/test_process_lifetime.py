"""No process outlives its run: a reward that never returns does not keep the rollout manager alive after the run
ends, and a SIGKILL of the driver's process group takes the sglang-router and the engine servers with it."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.helpers.run_processes import REPO, kill_group, kill_leftovers, small_grpo_argv, start_run, wait_gone, watch


def _python(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_process_exits_with_a_reward_thread_that_never_returns():
    result = _python("""
        import threading, time
        from slime.utils.daemon_threads import DaemonThreadPool

        pool = DaemonThreadPool(max_workers=2, thread_name_prefix="reward")
        assert pool.submit(sum, [1, 2]).result(timeout=5) == 3
        hung = pool.submit(time.sleep, 3600)
        failed = pool.submit(int, "x")
        assert isinstance(failed.exception(timeout=5), ValueError)  # the second thread serves while one hangs
        assert not hung.done()
        print("exiting")
    """, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "exiting", result.stderr


def test_child_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, time
        from slime.utils.parent_death import die_with_parent

        child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent())
        print(child.pid, flush=True)
        time.sleep(600)
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        assert child.is_running()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        child.wait(timeout=10)  # raises psutil.TimeoutExpired if the child outlives its parent
    finally:
        if child.is_running():
            child.kill()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


@pytest.mark.e2e
def test_hung_plain_reward_does_not_outlive_the_run(task, tmp_path):
    log_path = tmp_path / "train.log"
    argv = small_grpo_argv(task, tmp_path / "run", "--custom-rm-path", "tests.helpers.e2e_rewards.never_returns",
                           "--reward-timeout", "1")
    process = start_run(argv, log_path)
    watched = watch(process, timeout=400)
    try:
        assert process.wait(timeout=60) == 0, log_path.read_text()[-6000:]
        assert "took longer than 1.0s (--reward-timeout)" in log_path.read_text()  # the reward did hang
        assert any("RolloutManager" in cmdline for cmdline in watched.cmdlines.values())
        assert wait_gone(watched, timeout=30) == []
    finally:
        kill_leftovers(watched)


def _serving(watched) -> bool:
    commands = [listener.cmdline for listener in watched.listeners.values()]
    return any("sglang::router" in c for c in commands) and any("slime.engine.server" in c for c in commands)


@pytest.mark.e2e
def test_sigkill_of_driver_group_leaves_no_server(task, tmp_path):
    log_path = tmp_path / "train.log"
    process = start_run(small_grpo_argv(task, tmp_path / "run", "--rm-type", "math", "--num-rollout", "50"),
                        log_path)
    watched = watch(process, timeout=300, until=_serving)
    try:
        assert _serving(watched), log_path.read_text()[-6000:]
        kill_group(process)
        left = wait_gone(watched, timeout=10)
        assert not [c for c in left if "sglang::router" in c or "slime.engine.server" in c], left
        # Ray's own processes notice on their own that their raylet is gone; a worker still starting up takes longest.
        assert wait_gone(watched, timeout=90) == []
    finally:
        kill_leftovers(watched)


def test_sigterm_of_the_driver_alone_leaves_no_process(task, tmp_path):
    """`kill <driver pid>` (what a scheduler's time limit sends): the driver's actors, engines, router and its
    private Ray cluster all go."""
    log_path = tmp_path / "train.log"
    process = start_run(small_grpo_argv(task, tmp_path / "run", "--rm-type", "math", "--num-rollout", "50"),
                        log_path)
    watched = watch(process, timeout=300, until=_serving)
    try:
        assert _serving(watched), log_path.read_text()[-6000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        assert wait_gone(watched, timeout=90) == []
    finally:
        kill_leftovers(watched)
