"""slime.utils.weight_transport: tensors by shared-memory handle between unrelated processes (values, dtypes,
views; the segment outlives the sender's tensor and is unlinked once the receiver drops it; a packed list is one
segment, its tensors aligned copies of the originals), bad input, and a
custom gloo process group that works with and without a default group in the process."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slime.utils.misc import find_free_port
from slime.utils.weight_transport import (
    PACK_ALIGN_BYTES,
    deserialize_named_tensors,
    pack_named_tensors,
    parse_dtype,
    serialize_named_tensors,
)

REPO_ROOT = str(Path(__file__).resolve().parents[2])

RECEIVER = r"""
import sys, gc
from slime.utils.weight_transport import deserialize_named_tensors
named = deserialize_named_tensors(open(sys.argv[1]).read())
print(";".join(f"{n}|{t.dtype}|{list(t.shape)}|{t.double().sum().item():.6f}" for n, t in named))
del named
gc.collect()
"""


def run_python(code: str, *args, tmp_path: Path) -> str:
    # Files, not pipes: a torch_shm_manager child may inherit stdio and outlive the process.
    out = tmp_path / f"out-{time.monotonic_ns()}.txt"
    with open(out, "w") as stdout:
        returncode = subprocess.call(
            [sys.executable, "-c", code, *map(str, args)], stdout=stdout, stderr=subprocess.STDOUT, timeout=120,
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
        )
    text = out.read_text()
    assert returncode == 0, text[-3000:]
    return text.strip().splitlines()[-1]


def own_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{os.getpid()}_")}


@pytest.mark.parametrize("packed", [False, True])
def test_unrelated_process_reads_tensors_and_segments_are_freed(tmp_path, packed):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = [
        ("a.weight", base),
        ("b.bias", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        ("c.view", base[1:3, ::2]),  # a strided view of a larger storage
        ("d.ids", torch.tensor([7, 8, 9], dtype=torch.int64)),
        ("e.empty", torch.zeros(0, 3)),
        ("f.mask", torch.tensor([True, False, True])),
    ]
    expected = ";".join(f"{n}|{t.dtype}|{list(t.shape)}|{t.double().sum().item():.6f}" for n, t in named)
    before = own_segments()
    if packed:
        named = pack_named_tensors(named)
        assert len(own_segments() - before) == 1  # made in shared memory, one segment for the whole list
        assert len({t.untyped_storage().data_ptr() for _, t in named}) == 1
        assert all(t.data_ptr() % PACK_ALIGN_BYTES == 0 for _, t in named)
        base.add_(100)  # a copy: the packed tensors do not follow the originals
    payload = tmp_path / "payload.txt"
    payload.write_text(serialize_named_tensors(named))
    assert len(own_segments() - before) == (1 if packed else 5)  # tensors in shared memory (base's views share one)
    del named, base  # the sender drops its tensors before the receiver even starts
    assert run_python(RECEIVER, payload, tmp_path=tmp_path) == expected
    deadline = time.monotonic() + 10
    while own_segments() - before:
        assert time.monotonic() < deadline, f"leaked shared-memory segments {own_segments() - before}"
        time.sleep(0.1)


def test_round_trip_in_process_and_bad_input():
    tensor = torch.randn(3, 5)
    [(name, received)] = deserialize_named_tensors(serialize_named_tensors([("w", tensor)]))
    assert name == "w" and torch.equal(received, tensor)
    with pytest.raises(ValueError, match="not base64"):
        deserialize_named_tensors("definitely not base64 !!!")
    with pytest.raises(ValueError, match="pairs"):
        serialize_named_tensors([("w", [1, 2, 3])])


def test_parse_dtype():
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float32") is torch.float32
    assert parse_dtype(torch.int64) is torch.int64
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("float33")


GROUP_MEMBER = r"""
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from slime.utils.weight_transport import (broadcast_named_tensors, destroy_custom_process_group,
                                          init_custom_process_group, receive_named_tensors)
rank, port, default_port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == 0:
    # The trainer side already has a default group (of its own, size 1); the custom group must not care.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", world_size=1, rank=0)
group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, rank, "weights", timeout=timedelta(seconds=60))
shapes = [[2, 3], [4]]
if rank == 0:
    tensors = [("x", torch.arange(6.0).reshape(2, 3)), ("y", torch.tensor([1, 2, 3, 4], dtype=torch.int32))]
    broadcast_named_tensors(group, tensors, src=0)
    print("sent", flush=True)
    sys.stdin.readline()  # rank 0 hosts the rendezvous store: it must outlive rank 1's teardown
else:
    received = receive_named_tensors(group, ["x", "y"], ["float32", "int32"], shapes)
    print(";".join(f"{n}:{t.dtype}:{t.tolist()}" for n, t in received))
destroy_custom_process_group(group)
del group  # a process-group object still alive at interpreter teardown can abort the process
if dist.is_initialized():
    dist.destroy_process_group()
"""


def test_custom_group_broadcast_between_processes_with_and_without_default_group(tmp_path):
    port, default_port = find_free_port(), find_free_port()
    outputs = {}

    def start(rank):
        out = open(tmp_path / f"rank{rank}.txt", "w")
        process = subprocess.Popen(
            [sys.executable, "-c", GROUP_MEMBER, str(rank), str(port), str(default_port)],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
        )
        return process, out

    processes = [start(0), start(1)]
    processes[1][0].wait(90)
    processes[0][0].stdin.write(b"done\n")
    processes[0][0].stdin.close()
    for rank, (process, out) in enumerate(processes):
        assert process.wait(90) == 0, (tmp_path / f"rank{rank}.txt").read_text()[-3000:]
        out.close()
        outputs[rank] = (tmp_path / f"rank{rank}.txt").read_text().strip().splitlines()[-1]
    assert outputs[0] == "sent"
    assert outputs[1] == "x:torch.float32:[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]];y:torch.int32:[1, 2, 3, 4]"


def test_init_custom_process_group_rejects_bad_arguments():
    from slime.utils.weight_transport import init_custom_process_group

    with pytest.raises(ValueError, match="backend"):
        init_custom_process_group("mpi", "tcp://127.0.0.1:1", 2, 0, "g")
    with pytest.raises(ValueError, match="rank"):
        init_custom_process_group("gloo", "tcp://127.0.0.1:1", 2, 2, "g")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_only_the_tensor_handle_format_is_admitted(tmp_path):
    import base64
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    marker = tmp_path / "ran"
    real = [("w", torch.ones(2, 3)), ("e", torch.empty(0)), ("b", torch.zeros(4, dtype=torch.bfloat16))]
    [(name, _), (_, empty), (_, bf16)] = deserialize_named_tensors(serialize_named_tensors(real))
    assert name == "w" and empty.numel() == 0 and bf16.dtype is torch.bfloat16

    def forking(payload):
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(payload)
        return base64.b64encode(buffer.getvalue()).decode()

    rejected = [
        forking([("w", torch.ones(2)), ("x", _RunsCode(marker))]),  # a real tensor first, then code
        forking(_RunsCode(marker)),
        base64.b64encode(pickle.dumps([("x", getattr)])).decode(),
        base64.b64encode(pickle.dumps([("x", torch.ones(2))])).decode(),  # torch.save-style rebuild: not handles
        forking({"w": torch.ones(2)}),  # admitted globals, wrong shape of the result
        base64.b64encode(pickle.dumps([("x", 3)])).decode(),
    ]
    for payload in rejected:
        with pytest.raises(ValueError, match="rejected"):
            deserialize_named_tensors(payload)
    assert not marker.exists()
