"""The streaming safetensors writer (``storage.tensor_files.layout``/``put``): its bytes are those of
``safetensors`` ``save`` (compared byte for byte), it reads its arrays' memory without a copy, and it
streams through every storage backend (``Storage.put_stream``), a retry starting again from the first byte."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from conftest import make_bucket
from safetensors import safe_open
from safetensors.numpy import save as numpy_save
from safetensors.torch import save as torch_save

from raycheck.storage import tensor_files
from raycheck.storage.backend import RetryPolicy, Storage, StorageError
from raycheck.storage.tensor_files import BF16_BITS, as_numpy, layout, load, to_tensor

RNG = np.random.default_rng(0)


def rand(shape, dtype) -> np.ndarray:
    return RNG.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize,
                        dtype=np.uint8).view(dtype).reshape(shape)


MIXED = {  # every dtype a file may hold, bfloat16 as its bits; odd sizes so that offsets are unaligned
    "w.f32": rand((3, 5), np.float32), "w.bf16": rand((7,), BF16_BITS), "w.f16": rand((2, 3), np.float16),
    "w.f64": rand((3,), np.float64), "step": rand((1,), np.int64), "idx": rand((5,), np.int32),
    "i16": rand((3,), np.int16), "i8": rand((9,), np.int8), "u8": rand((11,), np.uint8),
    "mask": RNG.integers(0, 2, 13).astype(bool), "u32": rand((3,), np.uint32), "u64": rand((2,), np.uint64),
}
EDGES = {"scalar": np.array(1.5, dtype=np.float32), "scalar.bf16": rand((), BF16_BITS), "empty": np.zeros((0,), np.float32),
         "empty2d": np.zeros((3, 0), np.int64), "x": rand((4,), np.float32)}
STRIDED = {"cols": rand((6, 8), np.float32)[:, ::3], "t": rand((4, 5), np.float16).T, "rev": rand((9,), np.int32)[::-1],
           "bf16.t": rand((3, 4), BF16_BITS).T}
NAMES = {f"model.layers.{i}.{'x' * (i % 11)}": rand((i % 5 + 1,), np.float32) for i in range(300)}
NAMES |= {'quote"back\\slash': rand((2,), np.float32), "new\nline\ttab\x01\x7f": rand((2,), np.float32),
          "ünïcødé/名前": rand((2,), BF16_BITS), "": rand((1,), np.int8)}
DICTS = {"mixed": MIXED, "edges": EDGES, "strided": STRIDED, "names": NAMES, "none": {}}


def reference(arrays, metadata=None) -> bytes:
    """What the code before the streaming writer wrote: ``safetensors.torch.save`` of the arrays as tensors."""
    return torch_save({n: to_tensor(a) for n, a in arrays.items()}, metadata=metadata)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.mark.parametrize("metadata", [None, {}, {"format": "raycheck-diff-1"}])
@pytest.mark.parametrize("which", sorted(DICTS))
def test_bytes_equal_safetensors_save_and_load_back_bitwise(which, metadata):
    arrays = DICTS[which]
    blob = tensor_files.save(arrays, metadata)
    if not arrays and metadata == {}:  # safetensors 0.8 writes the header '{},"__metadata__":{}}' here: not JSON
        assert blob[8:].rstrip() == b'{"__metadata__":{}}' and reference(arrays, metadata)[8:10] == b"{}"
    else:
        assert blob == reference(arrays, metadata)
    if (arrays or metadata != {}) and not any(a.dtype == BF16_BITS for a in arrays.values()):  # the diffs' old writer
        assert blob == numpy_save({n: np.ascontiguousarray(a) for n, a in arrays.items()}, metadata=metadata)
    back = load(blob)
    assert {n: (a.dtype, a.shape, sha(a)) for n, a in back.items()} == {n: (a.dtype, a.shape, sha(a)) for n, a in arrays.items()}
    assert layout(arrays, metadata).nbytes == len(blob)


def test_metadata_of_several_keys_is_one_of_the_orders_safetensors_writes():
    """safetensors writes ``__metadata__``'s keys in a random order (a Rust HashMap); ours keep the given
    order, which safetensors produces too: found among its outputs, byte for byte."""
    metadata = {"format": "raycheck-diff-1", "first_step": "40", "last_step": "41"}
    ours = tensor_files.save(MIXED, metadata)
    seen = set()
    for _ in range(2000):
        seen.add(reference(MIXED, metadata))
        if ours in seen:
            break
    assert ours in seen, f"none of safetensors' {len(seen)} outputs equals ours"


def test_safetensors_opens_a_written_file_lazily(tmp_path):
    metadata = {"format": "x", "step": "3"}
    store = Storage(str(tmp_path))
    tensor_files.put(store, "a.safetensors", MIXED, metadata)
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert f.metadata() == metadata
        assert {n: sha(as_numpy(f.get_tensor(n))) for n in f.keys()} == {n: sha(a) for n, a in MIXED.items()}


def test_tensors_give_the_bytes_of_their_arrays_and_contiguous_arrays_are_not_copied():
    t = torch.randn(4, 6).to(torch.bfloat16)
    tensors = {"bf16": t, "f32.strided": torch.randn(5, 4).t(), "i64": torch.arange(3)}
    arrays = {n: tensor_files.as_numpy(v.contiguous()) for n, v in tensors.items()}
    assert tensor_files.save(tensors) == tensor_files.save(arrays) == torch_save({n: v.contiguous() for n, v in tensors.items()})
    big = rand((1000,), np.float32)
    (view,) = layout({"big": big}).data
    assert np.shares_memory(view, big)
    assert [len(p) for p in layout({"big": big}).pieces()][1:] == [4000]


def test_pieces_slice_big_tensors_and_restart_from_the_first_byte(monkeypatch):
    monkeypatch.setattr(tensor_files, "PIECE_BYTES", 64)
    arrays = {"a": rand((50,), np.float32), "b": rand((0,), np.float32), "c": rand((3,), np.int8)}
    file = layout(arrays)
    sizes = [len(p) for p in file.pieces()]
    assert sizes[1:] == [64, 64, 64, 8, 3] and 0 not in sizes
    assert b"".join(file.pieces()) == b"".join(file.pieces()) == tensor_files.save(arrays)


@pytest.mark.parametrize(("arrays", "metadata", "match"), [
    ({"c": np.zeros(2, np.complex64)}, None, "complex64"),
    ({"o": np.array(["x"], dtype=object)}, None, "object"),
    ({1: np.zeros(2, np.float32)}, None, "names are strings"),
    ({"a": np.zeros(2, np.float32)}, {"k": 1}, "strings to strings"),
])
def test_what_safetensors_cannot_hold_is_refused_in_one_line(arrays, metadata, match):
    with pytest.raises(ValueError, match=match):
        layout(arrays, metadata)


def test_put_streams_through_every_backend(storage):
    metadata = {"format": "x"}
    n, digest = tensor_files.put(storage, "diffs/a.safetensors", MIXED, metadata)
    blob = reference(MIXED, metadata)
    assert (n, digest) == (len(blob), hashlib.sha256(blob).hexdigest())
    assert storage.get("diffs/a.safetensors") == blob
    assert storage.list() == ["diffs/a.safetensors"]


@pytest.mark.parametrize("chunk_bytes", [4096, None])
def test_put_through_direct_local_writes_gives_the_bytes_of_safetensors(tmp_path, monkeypatch, chunk_bytes):
    """``Storage(write_direct=True)`` (``O_DIRECT``, an aligned buffer, the last chunk padded then cut off):
    pieces of every size cross the buffer's edges, and the file is byte for byte ``safetensors``'."""
    monkeypatch.setattr(tensor_files, "PIECE_BYTES", 1000)  # big tensors in pieces that straddle 4096-byte chunks
    arrays = MIXED | {"big": rand((3001,), np.float32), "odd": rand((4097,), np.uint8)}
    store = Storage(str(tmp_path), write_direct=True, write_chunk_bytes=chunk_bytes)
    blob = reference(arrays, {"format": "x"})
    assert tensor_files.put(store, "a.safetensors", arrays, {"format": "x"}) == (len(blob), hashlib.sha256(blob).hexdigest())
    assert (tmp_path / "a.safetensors").read_bytes() == blob and store.list() == ["a.safetensors"]


class FailsOnce:
    """Pieces of ``blob`` in ``piece``-byte slices; the first call raises after ``good`` pieces."""

    def __init__(self, blob: bytes, piece: int = 1000, good: int = 2) -> None:
        self.blob, self.piece, self.good, self.calls = blob, piece, good, 0

    def __call__(self):
        self.calls += 1
        for k, start in enumerate(range(0, len(self.blob), self.piece)):
            if self.calls == 1 and k == self.good:
                raise OSError("connection reset (injected)")
            yield memoryview(self.blob)[start:start + self.piece]


def reopened(storage: Storage, retry: RetryPolicy) -> Storage:
    return Storage(storage.uri, retry=retry, **storage.options)


def test_a_retry_restarts_the_stream_and_writes_the_same_bytes(storage):
    blob = tensor_files.save(NAMES)
    pieces = FailsOnce(blob)
    store = reopened(storage, RetryPolicy(attempts=2, base_delay_s=0.01))
    assert store.put_stream("obj", pieces) == (len(blob), hashlib.sha256(blob).hexdigest())
    assert pieces.calls == 2 and store.get("obj") == blob and store.list() == ["obj"]
    assert store.temp_files() == []


def test_a_failed_stream_leaves_nothing_visible(storage):
    store = reopened(storage, RetryPolicy(attempts=1))
    with pytest.raises(StorageError, match="injected"):
        store.put_stream("obj", FailsOnce(b"\x01" * 5000))
    assert store.list() == [] and not store.exists("obj")


def test_a_multipart_upload_that_fails_is_aborted_and_a_retry_completes_it(s3_endpoint):
    make_bucket(s3_endpoint, "stream-abort")
    store = Storage("s3://stream-abort/run", endpoint_url=s3_endpoint, retry=RetryPolicy(attempts=1))
    store.fs.default_block_size = 5 << 20  # S3's smallest part: the failure comes after two parts were uploaded
    blob = rand((13 << 20,), np.uint8).tobytes()
    with pytest.raises(StorageError, match="injected"):
        store.put_stream("big", FailsOnce(blob, piece=1 << 20, good=12))
    assert store.list() == [] and store.fs.call_s3("list_multipart_uploads", Bucket="stream-abort").get("Uploads", []) == []
    pieces = FailsOnce(blob, piece=1 << 20, good=12)
    pieces.calls = 1  # no failure this time
    assert store.put_stream("big", pieces) == (len(blob), hashlib.sha256(blob).hexdigest())
    assert store.get("big") == blob
