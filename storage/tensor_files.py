"""Safetensors bytes <-> numpy arrays, bfloat16 included.

numpy has no bfloat16, so a bfloat16 tensor travels through raycheck's numpy states (snapshots, shadow
images, hashes) as its raw bits in a uint16 array (``BF16_BITS``; ``as_numpy`` makes that view). A
shard keeps the dtype as it is: such an array is written as a safetensors ``BF16`` tensor, and a
``BF16`` tensor is read back as its uint16 bits (``F32`` and ``F16`` as float32 and float16 arrays). No
parameter of a model is an unsigned 16-bit integer, so the bits are never mistaken.

Writing (``put``, ``save``): the safetensors layout is produced here, straight from each array's memory,
so that a file is streamed to storage (``Storage.put_stream``) without an encoded copy of it: 8 bytes of
little-endian header length, the JSON header padded with spaces to a multiple of 8 bytes (``__metadata__``
first, then one entry per tensor in file order), then the tensors' raw little-endian C-order bytes, ordered
by descending dtype alignment, then by name. These are the rules of safetensors' ``prepare`` and ``Dtype``
(huggingface/safetensors, ``safetensors/src/tensor.rs``); tests/test_tensor_files.py checks byte equality
with ``safetensors.torch.save`` (its ``__metadata__`` keys come in a random order, ours in the given one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load as _load_tensors
from safetensors.torch import save_file as _save_tensor_file

if TYPE_CHECKING:
    from raycheck.storage.backend import Storage

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


SAFETENSORS_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "float16": "F16", "bfloat16": "BF16",
                      "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64"}
"""The safetensors dtype of each ``dtype_name`` that a file may hold, in the order of safetensors' ``Dtype``
enum (its file order is the reverse: descending alignment). No ``U16``: a uint16 array is ``BF16_BITS``."""

PIECE_BYTES = 8 << 20
"""Largest piece (bytes) that ``TensorFile.pieces`` yields: a slice of one tensor's memory, never a copy."""


@dataclass(frozen=True)
class TensorFile:
    """A safetensors file laid out over its arrays' memory: ``header`` (length and padded JSON, bytes) and
    ``data``, each tensor's bytes as a flat uint8 view of a C-contiguous array, in file order."""

    header: bytes
    data: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        """Size of the file, bytes."""
        return len(self.header) + sum(d.nbytes for d in self.data)

    def pieces(self) -> Iterator[memoryview]:
        """The file's bytes in order: the header, then slices of at most ``PIECE_BYTES`` of each tensor's
        memory (no empty piece). Each call starts again from the first byte."""
        yield memoryview(self.header)
        for d in self.data:
            view = d.data  # a memoryview of the array, no copy
            for start in range(0, len(view), PIECE_BYTES):
                yield view[start:start + PIECE_BYTES]


def layout(arrays: Mapping[str, np.ndarray | torch.Tensor], metadata: Mapping[str, str] | None = None) -> TensorFile:
    """The safetensors file of ``arrays`` (name -> numpy array or CPU tensor, any shape, 0-d and empty
    included; ``BF16_BITS`` arrays and bfloat16 tensors as ``BF16``) with the string ``metadata`` (None:
    no ``__metadata__``), over the arrays' memory: a strided or big-endian array is copied to a
    C-contiguous little-endian one, anything else is viewed, not copied (it must not change until the
    file is written).

    Raises:
        ValueError: a dtype outside ``SAFETENSORS_DTYPES``, a name or metadata that is not a string.
    """
    tensors = []
    for name, a in arrays.items():
        a = as_numpy(a)
        c = np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C")
        code = SAFETENSORS_DTYPES.get(dtype_name(c.dtype))
        if code is None or not isinstance(name, str):
            raise ValueError(f"tensor {name!r}: cannot be written as safetensors (dtype {a.dtype}; "
                             f"supported: {', '.join(SAFETENSORS_DTYPES)}; names are strings)")
        tensors.append((name, code, c))
    rank = {code: i for i, code in enumerate(SAFETENSORS_DTYPES.values())}
    tensors.sort(key=lambda t: (-rank[t[1]], t[0]))
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"safetensors metadata maps strings to strings, got {dict(metadata)!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, code, c in tensors:
        header[name] = {"dtype": code, "shape": list(c.shape), "data_offsets": [offset, offset + c.nbytes]}
        offset += c.nbytes
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return TensorFile(len(text).to_bytes(8, "little") + text, tuple(c.reshape(-1).view(np.uint8) for _, _, c in tensors))


def put(storage: Storage, rel: str, arrays: Mapping[str, np.ndarray | torch.Tensor],
        metadata: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Write ``arrays`` (and ``metadata``) as the safetensors object ``rel`` of ``storage``, streamed from
    the arrays' memory (``layout``, ``Storage.put_stream``: no encoded copy, a retry starts over).
    Returns ``(bytes, sha256 hex)`` of the object.

    Raises:
        ValueError: as ``layout``. storage.backend.StorageError: writing failed after retries.
    """
    return storage.put_stream(rel, layout(arrays, metadata).pieces)


def save(arrays: Mapping[str, np.ndarray | torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``arrays`` (``layout``, joined: a copy of every byte; ``put`` streams)."""
    return b"".join(layout(arrays, metadata).pieces())


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
