"""``shardcache verify``: recompute every checksum and check the structure of a cache.

Checks what the manifest promises: the manifest, every listed shard (size, sha256, schema,
offsets, counts, lengths within bucket and ``max_length``, ids ``<= max_token_id``), the length
index, the content key index (where the cache has one), the quarantine file and the totals.
Unlisted shard files are ``extra_files``, not problems. Memory is one record batch at a time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from shardcache.errors import CacheError, CacheNotFoundError
from shardcache.store.build_lock import sweep_dead_scratch
from shardcache.store.columns import TOKEN_COLUMNS, stored_columns
from shardcache.store.files import sha256_file
from shardcache.store.integrity import record_verified
from shardcache.store.layout import MANIFEST, SHARD_DIR, check_relative_name
from shardcache.store.manifest import MASKED_KINDS, read_manifest
from shardcache.store.remote import RemoteCache, cache_root, is_url, unreachable
from shardcache.store.shards import arrow_numpy


@dataclass
class Problem:
    """One damaged or missing file of a ``VerifyReport`` (kinds: see ``VerifyReport.add``)."""

    file: str
    kind: str
    message: str

    def to_json(self) -> dict[str, str]:
        """The problem as a ``file``/``kind``/``message`` dict."""
        return {"file": self.file, "kind": self.kind, "message": self.message}


@dataclass
class VerifyReport:
    """The outcome of [`verify_cache`][shardcache.verify_cache]; ``ok`` when no problem was found.

    Attributes:
        cache: the cache's folder or URL.
        files_checked: files hashed.
        bytes_checked: their bytes.
        problems: what is damaged or missing (``file``, ``kind``, ``message`` each).
        extra_files: shard files the manifest does not list (ignored by readers).
    """

    cache: str
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    extra_files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, file: str, kind: str, message: str) -> None:
        """Record a problem.

        Args:
            file: the file, relative to the cache.
            kind: ``missing``, ``size``, ``checksum``, ``structure``, ``index``, ``quarantine``,
                ``manifest``, ``totals`` or ``not_a_cache``.
            message: the details.
        """
        self.problems.append(Problem(file, kind, message))

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (``shardcache verify --json``).

        Returns:
            The fields, ``ok``, and the problems as dicts.
        """
        return {
            "cache": self.cache,
            "ok": self.ok,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [p.to_json() for p in self.problems],
            "extra_files": self.extra_files,
        }


def _check_file(report: VerifyReport, root: str, rel: str, entry: dict[str, Any]) -> bool:
    """Check presence, size and sha256 of one file; True when all match."""
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        report.add(rel, "missing", "listed in the manifest but not present")
        return False
    size = os.path.getsize(path)
    report.files_checked += 1
    report.bytes_checked += size
    if "bytes" in entry and size != int(entry["bytes"]):
        report.add(rel, "size", f"{size} bytes, the manifest says {entry['bytes']}")
        return False
    if "sha256" in entry:
        st = os.stat(path)
        if sha256_file(path) != entry["sha256"]:
            report.add(rel, "checksum", f"sha256 differs from the manifest's {entry['sha256']}")
            return False
        # readers (other processes, later epochs) trust this record instead of hashing again
        record_verified(path, str(entry["sha256"]), st)
    return True


def _column_problem(batch: pa.RecordBatch, name: str, offsets: np.ndarray) -> str | None:
    """What is wrong with a record batch's per-token column ``name``, or None.

    Its values must line up with the tokens and pass the column's own ``check`` against the
    loss mask (column 3).
    """
    spec = TOKEN_COLUMNS[name]
    column = batch.column(name)
    if column.values.null_count or not np.array_equal(arrow_numpy(column.offsets), offsets):
        return f"the {spec.label} do not line up"
    mask = batch.column(3).values.to_numpy(zero_copy_only=False)
    return spec.check(arrow_numpy(column.values), mask)


def _check_shard(
    report: VerifyReport,
    root: str,
    info: dict[str, Any],
    manifest: dict[str, Any],
    index: np.ndarray | None,
    first_row: int,
) -> tuple[int, int]:
    """Check the structure of one shard; return the (rows, tokens) actually found.

    ``first_row`` is the shard's first row in ``index``, against which its lengths are compared.
    """
    rel = f"{SHARD_DIR}/{info['name']}"
    dtype = np.dtype(manifest["dtype"])
    expected_type = pa.uint16() if dtype == np.uint16 else pa.uint32()
    ranges = manifest["buckets"]["ranges"]
    bucket = int(info["bucket"])
    low, high = ranges[bucket] if 0 <= bucket < len(ranges) else (1, None)
    max_length = manifest.get("options", {}).get("tokenize", {}).get("max_length")
    max_id = manifest.get("tokenizer", {}).get("max_token_id")
    rows = tokens = 0
    pairs: list[tuple[np.ndarray, np.ndarray]] | None = (
        [] if manifest.get("kind") == "preference" else None
    )  # per record batch: records and pieces, to check that rows come in pairs
    try:
        with pa.memory_map(os.path.join(root, rel), "r") as source:
            reader = pa.ipc.open_file(source)
            names = reader.schema.names
            expected = ["tokens", "record", "piece"]
            if manifest.get("kind") in MASKED_KINDS:
                expected.append("mask")  # chat and preference caches store a loss mask
            columns = stored_columns(manifest)  # per-token columns the build option named
            expected += columns
            if names != expected:
                report.add(rel, "structure", f"columns {names}, expected {'/'.join(expected)}")
                return 0, 0
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                column = batch.column(0)
                where = f"record batch {i}"
                if column.type.value_type != expected_type:
                    report.add(
                        rel,
                        "structure",
                        f"{where}: token type "
                        f"{column.type.value_type}, the manifest says {dtype.name}",
                    )
                    return rows, tokens
                offsets = arrow_numpy(column.offsets)
                values = arrow_numpy(column.values)
                lengths = np.diff(offsets)
                if len(offsets) and (offsets[0] != 0 or offsets[-1] != len(values)):
                    report.add(rel, "structure", f"{where}: offsets do not span the values")
                    return rows, tokens
                if np.any(lengths < 0):
                    report.add(rel, "structure", f"{where}: offsets decrease")
                    return rows, tokens
                if len(lengths) and (
                    lengths.min() < low
                    or (high is not None and lengths.max() > high)
                    or (max_length is not None and lengths.max() > max_length)
                ):
                    report.add(
                        rel,
                        "structure",
                        f"{where}: a sequence length outside bucket "
                        f"{bucket}'s range {low}..{high} (max_length {max_length})",
                    )
                if max_id is not None and len(values) and int(values.max()) > int(max_id):
                    report.add(
                        rel,
                        "structure",
                        f"{where}: token id {int(values.max())} above "
                        f"the tokenizer's max id {max_id}",
                    )
                if len(batch) and arrow_numpy(batch.column(1)).min() < 0:
                    report.add(rel, "structure", f"{where}: negative record index")
                if pairs is not None:
                    pairs.append((arrow_numpy(batch.column(1)).copy(),  # outlive the map
                                  arrow_numpy(batch.column(2)).copy()))  # fmt: skip
                if len(expected) > 3 and not np.array_equal(
                    arrow_numpy(batch.column(3).offsets), offsets
                ):
                    report.add(rel, "structure", f"{where}: the loss mask does not line up")
                for name in columns:
                    problem = _column_problem(batch, name, offsets)
                    if problem:
                        report.add(rel, "structure", f"{where}: {problem}")
                if index is not None:
                    start = first_row + rows
                    stored = index[start : start + len(lengths)]
                    if len(stored) != len(lengths) or not np.array_equal(stored, lengths):
                        report.add(
                            "index/lengths.npy",
                            "index",
                            f"rows {start}..{start + len(lengths) - 1} differ from {rel}",
                        )
                        index = None  # one report is enough
                rows += len(lengths)
                tokens += len(values)
    except (OSError, pa.ArrowException) as err:
        report.add(rel, "structure", f"not a readable Arrow IPC file: {err}")
        return rows, tokens
    if pairs is not None:
        _check_pairs(report, rel, pairs)
    if rows != int(info["rows"]) or tokens != int(info["tokens"]):
        report.add(
            rel,
            "structure",
            f"holds {rows} rows / {tokens} tokens, the manifest says "
            f"{info['rows']} / {info['tokens']}",
        )
    return rows, tokens


def _check_pairs(report: VerifyReport, rel: str, batches: list[tuple[Any, Any]]) -> None:
    """A preference shard's rows are pairs: rows 2k, 2k + 1 one record's pieces 0 and 1."""
    records = np.concatenate([r for r, _ in batches]) if batches else np.zeros(0, np.int64)
    pieces = np.concatenate([p for _, p in batches]) if batches else np.zeros(0, np.int32)
    if len(records) % 2:
        report.add(rel, "structure", f"{len(records)} rows: a preference shard holds pairs, "
                   "an even number of rows")  # fmt: skip
        return
    bad = np.flatnonzero((records[0::2] != records[1::2]) | (pieces[0::2] != 0)
                         | (pieces[1::2] != 1))  # fmt: skip
    if len(bad):
        k = int(bad[0])
        report.add(
            rel,
            "structure",
            f"rows {2 * k} and {2 * k + 1} are not a pair (records {int(records[2 * k])} / "
            f"{int(records[2 * k + 1])}, pieces {int(pieces[2 * k])} / "
            f"{int(pieces[2 * k + 1])}; expected one record's chosen (piece 0) then its "
            f"rejected (piece 1)); {len(bad)} such row pairs",
        )


def _load_index(report: VerifyReport, root: str, manifest: dict[str, Any]) -> np.ndarray | None:
    """Check and memory-map the length index; None when it is missing or damaged (reported)."""
    entry = manifest.get("index", {}).get("lengths")
    if not isinstance(entry, dict) or "name" not in entry:
        report.add("manifest.json", "manifest", "no index.lengths entry")
        return None
    rel = entry["name"]
    if not _check_file(report, root, rel, entry):
        return None
    try:
        index = np.load(os.path.join(root, rel), mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        report.add(rel, "index", f"not a readable .npy file: {err}")
        return None
    if index.dtype != np.uint32 or index.ndim != 1:
        report.add(rel, "index", f"dtype {index.dtype} / shape {index.shape}, expected 1-d uint32")
        return None
    return index


def _check_content_keys(
    report: VerifyReport, root: str, manifest: dict[str, Any], rows: int
) -> None:
    """Check the content key index: sha256, one uint64 per row, a pair's sides on one key."""
    entry = manifest["index"].get("content_keys")
    if not isinstance(entry, dict):
        return  # caches built before content keys
    rel = entry["name"]
    if not _check_file(report, root, rel, entry):
        return
    try:
        keys = np.load(os.path.join(root, rel), mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        report.add(rel, "index", f"not a readable .npy file: {err}")
        return
    if keys.dtype != np.uint64 or keys.shape != (rows,):
        report.add(rel, "index", f"dtype {keys.dtype} / shape {keys.shape}, expected {rows} "
                   "uint64 (one per row)")  # fmt: skip
        return
    if manifest.get("kind") == "preference" and rows % 2 == 0:
        parted = np.flatnonzero(keys[0::2] != keys[1::2])
        if len(parted):
            report.add(rel, "index", f"{len(parted)} pairs whose sides have different content "
                       f"keys (first: rows {2 * parted[0]} and {2 * parted[0] + 1})")  # fmt: skip


def _check_quarantine(report: VerifyReport, root: str, manifest: dict[str, Any]) -> None:
    """Check the quarantine file against the manifest's record and bad-record counts."""
    entry = manifest.get("quarantine")
    if not isinstance(entry, dict):
        return  # caches built before the quarantine was checksummed
    rel = entry["name"]
    if not _check_file(report, root, rel, entry):
        return
    lines = 0
    with open(os.path.join(root, rel), "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
    bad = sum((manifest.get("stats", {}).get("bad_records") or {}).values())
    if lines != int(entry["records"]) or lines != bad:
        report.add(
            rel,
            "quarantine",
            f"{lines} lines, the manifest says {entry['records']} records and {bad} bad records",
        )


def verify_cache(path: str | os.PathLike[str]) -> VerifyReport:
    """Check every file of a cache; damage is reported, never raised.

    Args:
        path: the cache folder, or its URL (every listed file is downloaded to a temporary folder).

    Returns:
        The report.

    Raises:
        CacheError: a URL's store cannot be reached (nothing was verified).
    """
    root = os.fspath(path)
    if is_url(root):
        return verify_remote(root)
    report = VerifyReport(cache=root)
    try:
        manifest = read_manifest(root)
    except CacheNotFoundError as err:  # not a cache at all: say so, not "corrupt"
        report.add(MANIFEST, "not_a_cache", str(err))
        return report
    except CacheError as err:
        report.add("manifest.json", "manifest", str(err))
        return report
    missing = [k for k in ("shards", "index", "totals", "buckets", "dtype") if k not in manifest]
    if missing:
        report.add("manifest.json", "manifest", f"missing keys {missing}")
        return report
    report.files_checked += 1
    index = _load_index(report, root, manifest)
    shards = manifest["shards"]
    first_row = 0
    for info in shards:
        rel = f"{SHARD_DIR}/{info['name']}"
        if _check_file(report, root, rel, info):
            _check_shard(report, root, info, manifest, index, first_row)
        first_row += int(info["rows"])
    if index is not None and len(index) != first_row:
        report.add(
            manifest["index"]["lengths"]["name"],
            "index",
            f"{len(index)} entries, the shards hold {first_row} rows",
        )
    _check_content_keys(report, root, manifest, first_row)
    _check_quarantine(report, root, manifest)
    totals = manifest["totals"]
    found = {
        "sequences": first_row,
        "tokens": sum(int(s["tokens"]) for s in shards),
        "shards": len(shards),
        "shard_bytes": sum(int(s["bytes"]) for s in shards),
    }
    if "inputs" in manifest:
        found["documents"] = sum(int(i.get("documents", 0)) for i in manifest["inputs"])
    for key, value in found.items():
        if key in totals and int(totals[key]) != value:
            report.add(
                "manifest.json",
                "totals",
                f"totals.{key} is {totals[key]} but the entries add up to {value}",
            )
    listed = {s["name"] for s in shards}
    shard_dir = os.path.join(root, SHARD_DIR)
    if os.path.isdir(shard_dir):
        report.extra_files = sorted(
            f"{SHARD_DIR}/{n}" for n in os.listdir(shard_dir) if n not in listed
        )
    return report


def verify_remote(url: str) -> VerifyReport:
    """``verify_cache`` for a URL, on copies of the listed files in a temporary folder.

    An unreachable store raises ``CacheError``; a missing or unreadable manifest is a problem.
    """
    url = url.rstrip("/")
    try:
        remote = RemoteCache(url)
    except CacheError as err:
        if err.__cause__ is not None and unreachable(err.__cause__, url) is not None:
            raise  # the store cannot be reached: nothing was verified (not "corrupt")
        report = VerifyReport(cache=url)
        kind = "not_a_cache" if isinstance(err, CacheNotFoundError) else "manifest"
        report.add(MANIFEST, kind, str(err))
        return report
    fs, root, manifest = remote.fs, remote.root, remote.manifest
    # a killed verify leaves its copy of the cache: the next one removes those of dead pids
    sweep_dead_scratch(cache_root())
    folder = tempfile.mkdtemp(prefix=f"verify-{os.getpid()}-", dir=cache_root())
    try:
        names = [MANIFEST]
        for entry in manifest.get("index", {}).values():  # the lengths and content keys
            if isinstance(entry, dict) and entry.get("name"):
                names.append(entry["name"])
        if manifest.get("quarantine"):
            names.append(manifest["quarantine"]["name"])
        names += [f"{SHARD_DIR}/{s['name']}" for s in manifest.get("shards", [])]
        for rel in names:  # validated by read_manifest; checked again where it is written
            local = os.path.join(folder, check_relative_name(rel, "manifest name"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # missing: reported by the verifier
                fs.get_file(f"{root}/{rel}", local)
        report = verify_cache(folder)
        with contextlib.suppress(FileNotFoundError):
            listed = {s["name"] for s in manifest.get("shards", [])}
            found = [p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/{SHARD_DIR}")]
            report.extra_files = sorted(f"{SHARD_DIR}/{n}" for n in found if n not in listed)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report.cache = url
    return report


def format_verify(report: VerifyReport) -> str:
    """The report as text: a line per problem and per extra file, then a summary line."""
    lines = [
        f"NOT A CACHE  {p.message}" if p.kind == "not_a_cache" else
        f"CORRUPT  {p.file}: {p.kind}: {p.message}"
        for p in report.problems
    ]  # fmt: skip
    lines += [
        f"extra    {name} (not in the manifest; ignored by readers)" for name in report.extra_files
    ]
    status = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    lines.append(
        f"verify {report.cache}: {status}; {report.files_checked} files, "
        f"{report.bytes_checked / 1e6:.1f} MB checked"
    )
    return "\n".join(lines)
