"""How memory the host hands in becomes the store's region: one flat uint8 view.

The store and the data plane address blocks as byte offsets into one region, so whatever
the host gives (a NumPy array, a torch CPU tensor, any writable C-contiguous buffer) is
viewed, never copied, as a flat ``uint8`` array; the original object is kept alive next
to the view. ``None`` allocates a page-aligned zeroed buffer. Anything that cannot be
viewed in place (a strided array, a read-only buffer, too few bytes) is refused with
``ValueError``, and a non-buffer with ``TypeError``, before anything else is built on it.

A torch CUDA tensor is a *device region* (:func:`adopt_device_region`): it is viewed as a
flat ``uint8`` CUDA tensor of the same memory (there is no host view of it), and
:func:`region_memory` names what the data plane registers: NIXL memory type ``"VRAM"``
and the tensor's own device index (``"DRAM"`` and 0 for host memory).

torch is never imported here: a host that hands in a tensor has already imported it, and
the core package must not depend on it.
"""

from __future__ import annotations

import mmap
import re
import sys
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "adopt_device_region",
    "adopt_region",
    "block_source",
    "device_bytes",
    "host_bytes",
    "is_device_region",
    "region_memory",
]

_PAGE: Final = mmap.PAGESIZE


def adopt_region(region: object | None, nbytes: int) -> tuple[object, npt.NDArray[np.uint8]]:
    """(object to keep alive, flat uint8 view of its first nbytes); never copies."""
    if region is None:
        try:
            raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)  # calloc: pages committed lazily
        except ValueError as exc:  # NumPy's word for a size past what it can address
            raise MemoryError(f"a region of {nbytes} bytes: {exc}") from None
        offset = -raw.ctypes.data % _PAGE
        flat = raw[offset : offset + nbytes]
        return flat, flat
    flat = host_bytes(region)
    if flat.nbytes < nbytes:
        raise ValueError(f"region is {flat.nbytes} bytes, need {nbytes}")
    return region, flat[:nbytes]


def host_bytes(region: object) -> npt.NDArray[np.uint8]:
    """All of host memory ``region`` as a flat, writable uint8 view (never a copy). The
    view holds the buffer's export while it lives: an mmap cannot be closed under it, a
    bytearray not resized, a torch CPU tensor's storage not resized."""
    if is_device_region(region):
        raise ValueError("a CUDA tensor is a device region: use adopt_device_region")
    if _is_torch_tensor(region):
        flat = _torch_bytes(region, writable=True)
    elif isinstance(region, np.ndarray):
        if region.dtype.hasobject:
            raise ValueError("region must not hold Python objects")
        if not region.flags.c_contiguous:
            raise ValueError("region must be C-contiguous")
        flat = region.reshape(-1).view(np.uint8)
    else:
        try:
            mv = memoryview(region)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"region must be a buffer, got {type(region).__name__}") from None
        if not mv.c_contiguous:
            raise ValueError("region must be C-contiguous")
        if _holds_objects(mv):
            raise ValueError("region must not hold Python objects")
        flat = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    if not flat.flags.writeable:
        raise ValueError("region must be writable")
    return flat


def is_device_region(region: object) -> bool:
    """True for a torch tensor that lives on a GPU (a device region)."""
    return _is_torch_tensor(region) and region.device.type == "cuda"  # type: ignore[attr-defined]


def region_memory(region: object) -> tuple[str, int]:
    """(NIXL memory type, device index) of a region: ("VRAM", n) for a tensor on cuda:n,
    ("DRAM", 0) for host memory."""
    if is_device_region(region):
        return "VRAM", int(region.device.index or 0)  # type: ignore[attr-defined]
    return "DRAM", 0


def adopt_device_region(region: object, nbytes: int) -> tuple[object, Any]:
    """(object to keep alive, flat uint8 CUDA tensor over its first nbytes); never copies.

    ``region`` must be a contiguous torch CUDA tensor of at least ``nbytes`` bytes."""
    if not is_device_region(region):
        raise ValueError(f"not a CUDA tensor: {type(region).__name__}")
    flat = device_bytes(region)
    if flat.numel() < nbytes:
        raise ValueError(f"region is {flat.numel()} bytes, need {nbytes}")
    return region, flat[:nbytes]


def device_bytes(region: object) -> Any:
    """All of CUDA tensor ``region`` as a flat uint8 CUDA tensor (never a copy)."""
    if not is_device_region(region):
        raise ValueError(f"not a CUDA tensor: {type(region).__name__}")
    tensor: Any = region
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return _as_uint8(tensor.detach().reshape(-1))


def _as_uint8(flat: Any) -> Any:
    """A flat tensor's memory as uint8, in place; ValueError where torch cannot view it so
    (a conjugate or negative view: its bytes are not what it reads as)."""
    torch = sys.modules["torch"]
    if flat.is_conj() or flat.is_neg():
        raise ValueError("tensor is a conjugate or negative view: its bytes differ from its values")
    if flat.dtype == torch.uint8:
        return flat
    try:
        return flat.view(torch.uint8)
    except RuntimeError as exc:
        raise ValueError(f"cannot view tensor as bytes: {exc}") from exc


def _holds_objects(mv: memoryview) -> bool:
    """The buffer's items are (or contain) Python object pointers: format code ``O``, as
    a NumPy object array or a ctypes ``py_object`` array exports (``'O'``, ``'<O'``,
    ``'T{O:a:i:b:}'``). Field names, between colons, are not codes."""
    fmt = mv.format
    return "O" in fmt and "O" in _FIELD_NAMES.sub("", fmt)


_FIELD_NAMES: Final = re.compile(r":[^:]*:")


def _is_torch_tensor(obj: object) -> bool:
    # Never import torch here: a host that hands us a tensor has already imported it.
    return hasattr(obj, "data_ptr") and any(
        cls.__name__ == "Tensor" and cls.__module__.partition(".")[0] == "torch"
        for cls in type(obj).__mro__
    )


def _torch_bytes(tensor: Any, *, writable: bool) -> npt.NDArray[np.uint8]:
    """A flat uint8 NumPy view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be on the CPU, not {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    flat = _as_uint8(tensor.detach().reshape(-1))
    try:
        array: npt.NDArray[np.uint8] = flat.numpy()
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"cannot view tensor as bytes: {exc}") from exc
    if tensor.numel() and array.ctypes.data != tensor.data_ptr():
        raise ValueError("tensor memory cannot be viewed without a copy")
    if writable and not array.flags.writeable:
        raise ValueError("region must be writable")
    return array


def block_source(data: object, block_len: int) -> npt.NDArray[np.uint8]:
    """``data`` (exactly ``block_len`` bytes: any buffer or a CPU tensor) as a flat uint8
    array to copy a block from; a non-contiguous buffer is copied once to make it so."""
    if _is_torch_tensor(data):
        data = _torch_bytes(data, writable=False)
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"data must be a buffer, got {type(data).__name__}") from None
    if _holds_objects(mv):
        # Its bytes are the objects' addresses: a block of them would hand peers pointers
        # into this process (and hold no reference to what they point at).
        raise ValueError("data must not hold Python objects")
    if mv.nbytes != block_len:
        raise ValueError(f"data is {mv.nbytes} bytes, block_len is {block_len}")
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)
