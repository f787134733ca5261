"""Safetensors bytes <-> numpy arrays, bfloat16 included.

numpy has no bfloat16, so a bfloat16 tensor travels through raycheck's numpy states (snapshots, shadow
images, hashes) as its raw bits in a uint16 array (``BF16_BITS``; ``as_numpy`` makes that view). A
shard keeps the dtype as it is: such an array is written as a safetensors ``BF16`` tensor, and a
``BF16`` tensor is read back as its uint16 bits (``F32`` and ``F16`` as float32 and float16 arrays). No
parameter of a model is an unsigned 16-bit integer, so the bits are never mistaken.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch
from safetensors.torch import load as _load_tensors
from safetensors.torch import save as _save_tensors
from safetensors.torch import save_file as _save_tensor_file

BF16_BITS = np.dtype("<u2")
"""The numpy dtype that carries a bfloat16 tensor's bits."""

FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})
"""The dtypes a run trains in (``dtype_name`` spelling)."""


def dtype_name(dtype: np.dtype) -> str:
    """The tensor dtype an array's dtype stands for, as torch spells it without the prefix:
    ``bfloat16`` for ``BF16_BITS``, else numpy's name (``float32``, ``float16``, ``int64``, ...)."""
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BF16_BITS else dtype.name


def to_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``a``'s memory when it can (a copy when ``a`` is read-only or strided):
    bfloat16 for a ``BF16_BITS`` array, else ``a``'s dtype."""
    t = torch.from_numpy(np.require(a, requirements=["C", "W"]))
    return t.view(torch.bfloat16) if a.dtype == BF16_BITS else t


def as_numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A numpy view (no copy) of a contiguous CPU tensor, or the array itself. numpy has no
    bfloat16: a bfloat16 tensor is viewed as its raw bits, a ``BF16_BITS`` array (``to_tensor``'s inverse)."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def save(arrays: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``arrays`` (``BF16_BITS`` arrays as ``BF16`` tensors)."""
    return _save_tensors({n: to_tensor(a) for n, a in arrays.items()}, metadata=metadata)


def save_file(arrays: Mapping[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``arrays`` as the safetensors file ``path`` (``BF16_BITS`` arrays as ``BF16`` tensors), with the
    permissions of any file this process creates (0666 less the umask; safetensors itself writes 0600, which
    another user or a serving container cannot read)."""
    _save_tensor_file({n: to_tensor(a) for n, a in arrays.items()}, path, metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def load(blob: bytes) -> dict[str, np.ndarray]:
    """The arrays of safetensors bytes (``BF16`` tensors as their ``BF16_BITS`` bits).

    Raises:
        safetensors.SafetensorError: ``blob`` is not a safetensors file.
    """
    return {n: as_numpy(t) for n, t in _load_tensors(bytes(blob)).items()}
