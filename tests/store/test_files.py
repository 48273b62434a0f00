"""Local files (shardcache/store/files.py): the hashing writer's digest is of the bytes on
disk, and the length-index concatenation writes what ``np.save`` of the joined slices would."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardcache import CorruptShardError
from shardcache.store.files import HashingWriter, write_npy_concat_atomic


def test_hashing_writer_digest_and_size_are_the_files(tmp_path):
    path = str(tmp_path / "f.bin")
    sink = HashingWriter(path)
    chunks = [b"abc", bytearray(b"x" * 5000), memoryview(os.urandom(3 << 20)), b""]
    for chunk in chunks:
        assert sink.write(chunk) == len(chunk)
    sink.write(pa.py_buffer(b"arrow buffer"))
    sink.close()
    sink.close()  # idempotent
    data = Path(path).read_bytes()
    assert data == b"".join(bytes(c) for c in chunks) + b"arrow buffer"
    assert (sink.bytes_written, sink.sha256.hexdigest()) == (
        len(data),
        hashlib.sha256(data).hexdigest(),
    )


def test_hashing_writer_under_an_arrow_ipc_writer(tmp_path):
    path = str(tmp_path / "t.arrow")
    sink = HashingWriter(path)
    batch = pa.record_batch([pa.array(np.arange(300_000, dtype=np.uint32))], names=["v"])
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), batch.schema) as writer:
        writer.write_batch(batch)
        writer.write_batch(batch.slice(7, 1000))
    sink.close()
    data = Path(path).read_bytes()
    assert sink.sha256.hexdigest() == hashlib.sha256(data).hexdigest()
    assert pa.ipc.open_file(path).read_all().num_rows == 301_000


def test_npy_concat_of_slices_is_np_save_of_the_joined_arrays(tmp_path):
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 1 << 20, size=n).astype(np.uint32) for n in (0, 17, 1000, 5)]
    names = []
    for k, arr in enumerate(arrays):
        names.append(str(tmp_path / f"{k}.npy"))
        np.save(names[-1], arr)
    slices = [(names[2], 10, 400), names[1], (names[0], 0, 0), (names[2], 0, 10),
              (names[3], 2, 5), (names[2], 400, 1000)]  # fmt: skip
    out = str(tmp_path / "joined.npy")
    write_npy_concat_atomic(out, slices)
    want = np.concatenate([arrays[2][10:400], arrays[1], arrays[2][:10], arrays[3][2:],
                           arrays[2][400:]])  # fmt: skip
    np.save(str(tmp_path / "want.npy"), want)
    assert Path(out).read_bytes() == (tmp_path / "want.npy").read_bytes()


def test_npy_concat_refuses_a_slice_past_the_end_or_mixed_dtypes(tmp_path):
    short, wide = str(tmp_path / "short.npy"), str(tmp_path / "wide.npy")
    np.save(short, np.arange(4, dtype=np.uint32))
    np.save(wide, np.arange(4, dtype=np.int64))
    with pytest.raises(CorruptShardError, match=r"short\.npy: holds 4 lengths"):
        write_npy_concat_atomic(str(tmp_path / "a.npy"), [(short, 2, 9)])
    with pytest.raises(CorruptShardError, match="disagree on the dtype"):
        write_npy_concat_atomic(str(tmp_path / "b.npy"), [short, wide])
    assert not os.path.exists(tmp_path / "a.npy") and not os.path.exists(tmp_path / "b.npy")
