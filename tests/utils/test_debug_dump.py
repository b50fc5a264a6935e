"""--save-debug-rollout-data written in the background (slime.utils.debug_dump.BackgroundDumpWriter): the file is
the samples as they were when saved, loads with --load-debug-rollout-data, errors surface, and the process's exit
waits for the write. Also Sample.to_dict's copy of the per-token lists."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from slime.utils.debug_dump import BackgroundDumpWriter, load_samples
from slime.utils.types import Sample

REPO = Path(__file__).resolve().parents[2]


def _samples(count: int, response_length: int = 64, routed_experts: bool = False) -> list[Sample]:
    # routed_experts: a numpy array, which torch.load(weights_only=True) refuses in a dump
    return [Sample(index=i, group_index=i // 2, prompt=[{"role": "user", "content": f"q{i}"}],
                   tokens=list(range(i, i + 16 + response_length)), response_length=response_length,
                   loss_mask=[1] * response_length, rollout_log_probs=[-0.5 - i] * response_length,
                   weight_versions=["3"], reward={"score": float(i)}, metadata={"tags": [i]},
                   rollout_routed_experts=np.full((15 + response_length, 2, 1), i, dtype=np.int32)
                   if routed_experts else None,
                   status=Sample.Status.TRUNCATED) for i in range(count)]


def test_to_dict_is_a_deep_copy_equal_to_deepcopys():
    sample = _samples(1, routed_experts=True)[0]
    reference = copy.deepcopy(sample.__dict__)
    value = sample.to_dict()
    for key in ("tokens", "loss_mask", "rollout_log_probs", "weight_versions", "metadata", "prompt"):
        assert value[key] == reference[key] and value[key] is not getattr(sample, key), key
    assert value["status"] == "truncated" and value["reward"] == {"score": 0.0}
    np.testing.assert_array_equal(value["rollout_routed_experts"], sample.rollout_routed_experts)
    value["tokens"].append(-1)
    value["metadata"]["tags"].append(-1)
    value["rollout_routed_experts"][0, 0, 0] = 99
    assert sample.tokens == reference["tokens"] and sample.metadata == {"tags": [0]}
    assert sample.rollout_routed_experts[0, 0, 0] == 0


@pytest.mark.parametrize("name", ["{rollout_id}.pt", "{rollout_id}.json"])
def test_the_dump_holds_the_samples_as_saved_and_loads(tmp_path, name):
    writer = BackgroundDumpWriter()
    samples = _samples(6)
    expected = [s.to_dict() for s in samples]
    path = tmp_path / name.format(rollout_id=4)
    writer.save(path, 4, samples)
    for sample in samples:  # what the manager does next, while the file may still be being written
        sample.rollout_id = 100 + sample.index
        sample.tokens.append(7)
        sample.metadata["tags"].append("later")
    writer.flush()
    assert [s.to_dict() for s in load_samples(path, "--load-debug-rollout-data")] == expected
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left behind


@pytest.mark.parametrize("name", ["{rollout_id}.pt", "{rollout_id}.json"])
def test_a_dump_with_r3_routing_loads_back_as_numpy(tmp_path, name):
    # R3's routing is a numpy array: a torch file holds it as a tensor (weights_only loading refuses numpy), a JSON
    # file as nested lists; both come back as the int32 arrays that routing replay reads.
    samples = _samples(3, response_length=5, routed_experts=True)
    path = tmp_path / name.format(rollout_id=2)
    writer = BackgroundDumpWriter()
    writer.save(path, 2, samples)
    writer.flush()
    loaded = load_samples(path, "--load-debug-rollout-data")
    for before, after in zip(samples, loaded, strict=True):
        assert isinstance(after.rollout_routed_experts, np.ndarray) and after.rollout_routed_experts.dtype == np.int32
        np.testing.assert_array_equal(after.rollout_routed_experts, before.rollout_routed_experts)
        assert after.tokens == before.tokens and after.rollout_log_probs == before.rollout_log_probs


def test_a_failed_write_surfaces_on_flush_and_the_next_save(tmp_path):
    (tmp_path / "a_file").write_text("")
    writer = BackgroundDumpWriter()
    writer.save(tmp_path / "a_file" / "0.pt", 0, _samples(2))  # its folder cannot be made
    with pytest.raises(RuntimeError, match=r"--save-debug-rollout-data: writing .*a_file/0.pt failed"):
        writer.flush()
    writer.flush()  # reported once
    writer.save(tmp_path / "a_file" / "1.pt", 1, _samples(2))
    with pytest.raises(RuntimeError, match="a_file/1.pt failed"):
        writer.save(tmp_path / "2.pt", 2, _samples(2))
    writer.save(tmp_path / "2.pt", 2, _samples(2))
    writer.flush()
    assert len(load_samples(tmp_path / "2.pt", "--load-debug-rollout-data")) == 2


def test_the_process_exit_waits_for_the_write(tmp_path):
    path = tmp_path / "0.pt"
    code = f"""
        from pathlib import Path
        from slime.utils.debug_dump import BackgroundDumpWriter
        from slime.utils.types import Sample
        samples = [Sample(index=i, tokens=list(range(4000)), response_length=4000) for i in range(200)]
        BackgroundDumpWriter().save(Path({str(path)!r}), 0, samples)
        """  # returns at once; the main thread ends with the write in flight
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, check=True, timeout=120,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    loaded = load_samples(path, "--load-debug-rollout-data")
    assert len(loaded) == 200 and loaded[-1].tokens == list(range(4000))


class _DumpingActor:
    """The part of RolloutManager the driver's failure path talks to: a dump saved in the background, then
    `flush_debug_dump`."""

    def __init__(self):
        self.debug_dump_writer = BackgroundDumpWriter()

    def save(self, path: str) -> None:
        samples = [Sample(index=i, tokens=list(range(4000)), response_length=4000) for i in range(200)]
        self.debug_dump_writer.save(Path(path), 0, samples)

    def flush_debug_dump(self) -> None:
        self.debug_dump_writer.flush()


def test_a_failing_run_leaves_the_dump_of_its_last_rollout(tmp_path, monkeypatch):
    import ray

    monkeypatch.syspath_prepend(str(REPO))  # train.py, the driver
    from train import rollout_dump_kept_on_failure

    workers_import = {"env_vars": {"PYTHONPATH": str(REPO)}}  # this module's actor class, as tests.utils.test_debug_dump
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=workers_import)
    try:
        manager = ray.remote(_DumpingActor).remote()
        path = tmp_path / "0.pt"
        with pytest.raises(FloatingPointError, match="loss is NaN"):
            with rollout_dump_kept_on_failure(manager):
                ray.get(manager.save.remote(str(path)))  # returns with the write in flight
                raise FloatingPointError("loss is NaN")  # the trainer fails; the driver process ends next
        assert len(load_samples(path, "--load-debug-rollout-data")) == 200
    finally:
        ray.shutdown()
