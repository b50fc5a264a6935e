"""Decoding the tensor-handle pickles of `POST /update_weights_from_tensor` without running anyone's code.

The wire format is SGLang's (torch's multiprocessing reductions through `ForkingPickler`: a list of
`(name, tensor)` whose tensors are rebuilt from shared-memory file names or CUDA IPC handles), so slime's trainer,
ours and real SGLang still talk to each other. A plain `pickle.loads` of such a body runs whatever callable the
sender names; here an unpickler admits exactly the globals that format needs (the tensor and storage rebuild
functions, the tensor and storage classes, `torch.Size` and torch dtypes), each by exact module and name, never
by module prefix (SGLang's first fix allowlisted `torch.` and was bypassed).

Two passes: the first resolves every global of the payload to an inert stand-in and checks the shape of the
result (a list of `(str, tensor)` pairs), so a payload that names anything else is rejected before any object is
built; only then does the second pass rebuild the tensors. Not a general safe-pickle library: nothing but this
format is admitted.
"""

from __future__ import annotations

import io
import pickle

import torch

_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED_CALLABLES = frozenset(
    {
        (_REDUCTIONS, "rebuild_tensor"),  # CPU tensor over a storage
        (_REDUCTIONS, "rebuild_cuda_tensor"),  # CUDA tensor from an IPC handle
        (_REDUCTIONS, "rebuild_storage_filename"),  # shared-memory file (file_system strategy)
        (_REDUCTIONS, "rebuild_storage_empty"),  # zero-byte storage
        (_REDUCTIONS, "rebuild_typed_storage"),
        (_REDUCTIONS, "rebuild_typed_storage_child"),
    }
)
ALLOWED_CLASSES = frozenset(
    {
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch", "TypedStorage"),
    }
)


class ForbiddenPickleError(ValueError):
    """The payload names a global outside the tensor-handle format."""


def _resolve(module: str, name: str):
    """The real object for an admitted (module, name); ForbiddenPickleError for anything else."""
    if (module, name) in ALLOWED_CALLABLES or (module, name) in ALLOWED_CLASSES:
        owner = {"torch": torch, "torch.storage": torch.storage, "torch.nn.parameter": torch.nn.parameter,
                 _REDUCTIONS: torch.multiprocessing.reductions}[module]
        return getattr(owner, name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise ForbiddenPickleError(
        f"the payload names {module}.{name}, which is not part of the tensor-handle format (only torch's tensor and "
        "storage rebuild functions, tensor/storage classes, torch.Size and dtypes are admitted)"
    )


class _Inert:
    """Stand-in for every admitted callable's result in the checking pass: accepts any state, builds nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _inert_callable(*args, **kwargs):
    return _Inert()


class _CheckingUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        value = _resolve(module, name)
        if isinstance(value, torch.dtype) or value is torch.Size:
            return value  # plain values, safe to use as they are
        return _Inert if isinstance(value, type) else _inert_callable

    def persistent_load(self, pid):
        raise ForbiddenPickleError("the payload uses persistent ids, which the tensor-handle format does not")


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _resolve(module, name)

    def persistent_load(self, pid):
        raise ForbiddenPickleError("the payload uses persistent ids, which the tensor-handle format does not")


def _is_named_tensor_list(value, tensor_type) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], tensor_type)
        for item in value
    )


def loads_named_tensors(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Decode a `[(name, tensor), ...]` handle pickle. ForbiddenPickleError (a ValueError) when the payload names
    any other global or has another shape, raised before any tensor or other object is built."""
    skeleton = _CheckingUnpickler(io.BytesIO(payload)).load()
    if not _is_named_tensor_list(skeleton, _Inert):
        raise ForbiddenPickleError("the payload is not a list of (name, tensor) pairs")
    named_tensors = _TensorUnpickler(io.BytesIO(payload)).load()
    if not _is_named_tensor_list(named_tensors, torch.Tensor):
        raise ForbiddenPickleError("the payload is not a list of (name, tensor) pairs")
    return named_tensors
