"""Small shared helpers: loading user hooks by dotted path, free ports, seeding, a singleton metaclass."""

from __future__ import annotations

import contextlib
import importlib
import random
import socket
import threading
import time


def _load_attribute(path: str, flag: str):
    """Import `module.attr` (or `module:attr`) and return the attribute; ValueError naming `flag` otherwise."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag}: expected a dotted path like 'my_pkg.my_module.my_fn', got {path!r}")
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep:
        raise ValueError(f"{flag}: {path!r} is not a dotted path like 'my_pkg.my_module.my_fn'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"{flag}: cannot import module {module_name!r} from {path!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{flag}: module {module_name!r} has no attribute {attr!r}") from None


def load_function(path: str, flag: str = "a hook path"):
    """Import `module.attr` (or `module:attr`) and return the attribute, which must be callable.

    `flag` names the CLI flag the path came from, so a typo gives an error the user can act on.
    """
    hook = _load_attribute(path, flag)
    if not callable(hook):
        raise ValueError(f"{flag}: {path!r} is a {type(hook).__name__}, not a function; name a function or class")
    return hook


def load_functions(path: str, flag: str) -> list:
    """Like `load_function`, but the attribute may also be a non-empty list (or tuple) of functions."""
    value = _load_attribute(path, flag)
    functions = list(value) if isinstance(value, (list, tuple)) else [value]
    if not functions or not all(callable(f) for f in functions):
        raise ValueError(f"{flag}: {path!r} must name a function or a non-empty list of functions")
    return functions


def _ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' local ports (Linux), or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return None


def _all_bindable(host: str, ports: range) -> bool:
    sockets = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for sock in sockets:
            sock.close()


def find_free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port free now, with the `count - 1` ports after it. It is picked below the kernel's ephemeral range where
    there is room, so no outgoing connection can be given it between this pick and the listener's bind (a port
    the kernel hands out, as binding port 0 does, can be; CI saw that as EADDRINUSE)."""
    ephemeral = _ephemeral_port_range()
    low, high = (10000, ephemeral[0]) if ephemeral and ephemeral[0] > 10000 + 1000 + count else (1024, 65536)
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(low, high - count + 1)
        if _all_bindable(host, range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free port(s) found on {host} in {low}-{high - 1}")


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def use_deterministic_kernels() -> None:
    """--deterministic-mode in a training process: torch picks deterministic kernels (and errors on an op that has
    none) and cuBLAS a fixed workspace; TF32 off. Called before the model is built."""
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def freeze_startup_objects() -> None:
    """Collect garbage, then move every surviving object into the collector's permanent generation (`gc.freeze`).
    A process that keeps its start-up objects (torch, transformers, the model) for life then stops rescanning them:
    with an engine loaded, a full collection took ~150 ms on a 2-core CPU with 388k tracked objects and ~0 ms after
    the freeze, and such a pause would otherwise land inside a random generation step. Call it once, in a process
    that serves one long-lived engine (not in one that builds and drops engines: frozen cycles are never freed);
    they are unfrozen at exit so that interpreter shutdown still finalises them."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """`metrics[key]` = the seconds the with-block took (set even when it raises)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = time.perf_counter() - started


class SingletonMeta(type):
    """A metaclass giving each class one instance, made on the first call (slime's `SingletonMeta`; the agent
    harnesses use it). `clear_instances(cls)` forgets a class's instance, so the next call builds a fresh one."""

    _instances: dict = {}
    _lock = threading.RLock()

    def __call__(cls, *args, **kwargs):
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    @staticmethod
    def clear_instances(cls=None) -> None:
        """Forget `cls`'s instance (every instance when None)."""
        with SingletonMeta._lock:
            if cls is None:
                SingletonMeta._instances.clear()
            else:
                SingletonMeta._instances.pop(cls, None)
