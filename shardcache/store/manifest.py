"""The manifest: the commit point of a cache, read and checked in one place.

A build's commit writes ``manifest.json`` last and atomically: its presence means the cache is
complete. Every reader gets it through ``read_manifest``, which guards the parse (NaN, Infinity,
nesting that exhausts the stack) and validates it: each key a reader uses then has the type and
range it needs, and each name and digest passes ``layout``'s checks. A malformed manifest is one
``CorruptShardError`` naming the field and value, never a ``KeyError`` or ``TypeError`` later.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from shardcache.config import KINDS
from shardcache.errors import CacheError, CacheNotFoundError, CorruptShardError
from shardcache.store.build_lock import running_build
from shardcache.store.layout import (
    CONTENT_KEYS_FILE,
    FORMAT_VERSION,
    LENGTHS_FILE,
    MANIFEST,
    PARTITION_ID,
    PARTS_DIR,
    QUARANTINE,
    SHA256_HEX,
    SHARD_NAME,
    check_digest,
    check_shard_name,
)

#: Counts and sizes fit an int64 (numpy arrays of row starts, ``np.fromiter``).
MAX_COUNT = 2**63 - 1
DTYPES = ("uint16", "uint32")
#: The kinds whose shards store a loss mask per token (a ``mask`` column): all but plain text.
MASKED_KINDS = tuple(kind for kind in KINDS if kind != "text")
TOTALS = ("documents", "sequences", "tokens", "shards", "shard_bytes", "input_bytes")
STATS = ("truncated_documents", "dropped_documents", "split_documents", "empty_documents",
         "lost_tokens")  # fmt: skip


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a manifest may hold")


def parse_manifest_text(text: str, where: str) -> dict[str, Any]:
    """A manifest's JSON object, not yet validated (CorruptShardError: not a JSON object)."""
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # json's C scanner guards its recursion
        raise CorruptShardError(
            f"{where}: cannot parse the manifest ({err}); rebuild the cache"
        ) from err
    if not isinstance(data, dict):
        raise CorruptShardError(
            f"{where}: the manifest is a JSON {type(data).__name__}, not an object; rebuild "
            "the cache"
        )
    return data


class _Check:
    """Field checks that raise one CorruptShardError naming the field and the value."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, value: Any, expected: str) -> CorruptShardError:
        shown = repr(value)
        shown = shown if len(shown) <= 120 else shown[:120] + "..."
        return CorruptShardError(
            f"{self.where}: manifest field {field} is {shown}, expected {expected}; the "
            "manifest is damaged or not written by this shardcache: rebuild the cache"
        )

    def get(self, obj: dict[str, Any], key: str, field: str) -> Any:
        if key not in obj:
            raise CorruptShardError(
                f"{self.where}: manifest field {field} is missing; the manifest is damaged or "
                "not written by this shardcache: rebuild the cache"
            )
        return obj[key]

    def obj(self, obj: dict[str, Any], key: str, field: str) -> dict[str, Any]:
        value = self.get(obj, key, field)
        if not isinstance(value, dict):
            raise self.fail(field, value, "an object")
        return value

    def list(self, obj: dict[str, Any], key: str, field: str) -> list[Any]:
        value = self.get(obj, key, field)
        if not isinstance(value, list):
            raise self.fail(field, value, "a list")
        return value

    def int(self, value: Any, field: str, low: int = 0, high: int = MAX_COUNT) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(field, value, f"an integer in {low}..{high}")
        return value

    def str(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise self.fail(field, value, "a string")
        return value

    def choice(self, value: Any, field: str, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise self.fail(field, value, f"one of {', '.join(allowed)}")
        return value

    def name(self, check: Any, value: Any, field: str) -> str:
        try:
            return check(value, field)
        except CacheError as err:
            raise CorruptShardError(f"{self.where}: {err}") from None


def validate_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """Check what readers take from a manifest and return it (CorruptShardError: a bad field)."""
    c = _Check(where)
    if not isinstance(manifest, dict):
        raise c.fail("(the whole manifest)", type(manifest).__name__, "an object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise CorruptShardError(
            f"{where}: format_version {version!r} is not supported by this shardcache "
            f"(reads {FORMAT_VERSION}); rebuild the cache or use a matching shardcache version"
        )
    c.choice(manifest.get("kind", "text"), "kind", KINDS)
    dtype = c.choice(c.get(manifest, "dtype", "dtype"), "dtype", DTYPES)
    c.str(c.get(manifest, "shardcache_version", "shardcache_version"), "shardcache_version")
    tokenizer = c.obj(manifest, "tokenizer", "tokenizer")
    c.int(c.get(tokenizer, "vocab_size", "tokenizer.vocab_size"), "tokenizer.vocab_size")
    # ids are stored as ``dtype``, and padded rows hold pad_id: both within the tokenizer
    largest = c.int(c.get(tokenizer, "max_token_id", "tokenizer.max_token_id"),
                    "tokenizer.max_token_id", high=int(np.iinfo(np.dtype(dtype)).max))  # fmt: skip
    c.int(c.get(tokenizer, "pad_id", "tokenizer.pad_id"), "tokenizer.pad_id", high=largest)
    for key in ("path", "class"):
        c.str(c.get(tokenizer, key, f"tokenizer.{key}"), f"tokenizer.{key}")
    ranges = c.list(c.obj(manifest, "buckets", "buckets"), "ranges", "buckets.ranges")
    for i, pair in enumerate(ranges):
        field = f"buckets.ranges[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise c.fail(field, pair, "a [low, high] pair")
        c.int(pair[0], f"{field}[0]")
        if pair[1] is not None:
            c.int(pair[1], f"{field}[1]", low=pair[0])
    shards = c.list(manifest, "shards", "shards")
    for i, shard in enumerate(shards):
        if _plain_shard_entry(shard, len(ranges)):
            continue  # every check below would pass (the common case: one test per shard)
        field = f"shards[{i}]"
        if not isinstance(shard, dict):
            raise c.fail(field, shard, "an object")
        c.name(check_shard_name, c.get(shard, "name", f"{field}.name"), f"{field}.name")
        c.name(check_digest, c.get(shard, "sha256", f"{field}.sha256"), f"{field}.sha256")
        bucket = c.get(shard, "bucket", f"{field}.bucket")
        c.int(bucket, f"{field}.bucket", 0, len(ranges) - 1)
        for key in ("rows", "tokens", "bytes"):
            c.int(c.get(shard, key, f"{field}.{key}"), f"{field}.{key}")
        if "sources" not in shard:
            _check_run(c, shard, field)
            continue
        runs = c.list(shard, "sources", f"{field}.sources")  # a merged shard
        if not runs:
            raise c.fail(f"{field}.sources", runs, "at least one {partition, source, rows}")
        for k, run in enumerate(runs):
            if not isinstance(run, dict):
                raise c.fail(f"{field}.sources[{k}]", run, "an object")
            _check_run(c, run, f"{field}.sources[{k}]")
            c.int(c.get(run, "rows", f"{field}.sources[{k}].rows"), f"{field}.sources[{k}].rows")
        if sum(run["rows"] for run in runs) != shard["rows"]:
            raise c.fail(f"{field}.sources", runs, f"runs adding up to its {shard['rows']} rows")
    index = c.obj(manifest, "index", "index")
    _check_file_entry(c, c.obj(index, "lengths", "index.lengths"), "index.lengths", LENGTHS_FILE)
    if "content_keys" in index:  # caches built before content keys: none
        keys = c.obj(index, "content_keys", "index.content_keys")
        _check_file_entry(c, keys, "index.content_keys", CONTENT_KEYS_FILE)
    if "quarantine" in manifest:  # caches built before the quarantine was checksummed: none
        quarantine = c.obj(manifest, "quarantine", "quarantine")
        _check_file_entry(c, quarantine, "quarantine", QUARANTINE)
        c.int(c.get(quarantine, "records", "quarantine.records"), "quarantine.records")
    totals = c.obj(manifest, "totals", "totals")
    for key in TOTALS:
        c.int(c.get(totals, key, f"totals.{key}"), f"totals.{key}")
    tokenize = c.obj(c.obj(manifest, "options", "options"), "tokenize", "options.tokenize")
    max_length = c.get(tokenize, "max_length", "options.tokenize.max_length")
    if max_length is not None:  # None: no limit
        c.int(max_length, "options.tokenize.max_length")
    c.str(c.get(tokenize, "truncation", "options.tokenize.truncation"),
          "options.tokenize.truncation")  # fmt: skip
    stats = c.obj(manifest, "stats", "stats")
    for key in STATS:
        c.int(c.get(stats, key, f"stats.{key}"), f"stats.{key}")
    c.list(stats, "corrupt_files", "stats.corrupt_files")
    bad = c.obj(stats, "bad_records", "stats.bad_records")
    for reason, count in bad.items():
        c.int(count, f"stats.bad_records.{reason}")
    for i, entry in enumerate(c.list(manifest, "inputs", "inputs")):
        if not isinstance(entry, dict):
            raise c.fail(f"inputs[{i}]", entry, "an object")
        c.int(entry.get("documents", 0), f"inputs[{i}].documents")
    c.int(c.get(manifest, "partitions", "partitions"), "partitions")
    if "key" in manifest:  # caches built before the cache key: none
        key = c.obj(manifest, "key", "key")
        c.obj(key, "components", "key.components")
        c.name(check_digest, c.get(key, "digest", "key.digest"), "key.digest")
    return manifest


def _check_run(c: _Check, entry: dict[str, Any], field: str) -> None:
    """Check an entry's ``partition`` (a partition id) and ``source`` (a string)."""
    partition = c.str(c.get(entry, "partition", f"{field}.partition"), f"{field}.partition")
    if not PARTITION_ID.fullmatch(partition):
        raise c.fail(f"{field}.partition", partition, "a partition id like 'p00000'")
    c.str(c.get(entry, "source", f"{field}.source"), f"{field}.source")


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


def _plain_shard_entry(shard: Any, buckets: int) -> bool:
    """True when a shard entry passes every check of ``validate_manifest``: the fast path per entry.

    Exact types only, so anything unusual takes the field-by-field path that names the bad field.
    """
    if type(shard) is not dict:
        return False
    name, digest, partition = shard.get("name"), shard.get("sha256"), shard.get("partition")
    bucket, source = shard.get("bucket"), shard.get("source")
    return (
        type(name) is str
        and SHARD_NAME.fullmatch(name) is not None
        and type(digest) is str
        and SHA256_HEX.fullmatch(digest) is not None
        and type(bucket) is int
        and 0 <= bucket < buckets
        and _is_count(shard.get("rows"))
        and _is_count(shard.get("tokens"))
        and _is_count(shard.get("bytes"))
        and type(partition) is str
        and PARTITION_ID.fullmatch(partition) is not None
        and type(source) is str
        and "sources" not in shard
    )


def _check_file_entry(c: _Check, entry: dict[str, Any], field: str, name: str) -> None:
    if c.get(entry, "name", f"{field}.name") != name:
        raise c.fail(f"{field}.name", entry["name"], repr(name))
    c.int(c.get(entry, "bytes", f"{field}.bytes"), f"{field}.bytes")
    c.name(check_digest, c.get(entry, "sha256", f"{field}.sha256"), f"{field}.sha256")


def read_manifest(cache_dir: str) -> dict[str, Any]:
    """Read and validate a cache's ``manifest.json`` (CacheNotFoundError: none committed there)."""
    path = os.path.join(cache_dir, MANIFEST)
    if not os.path.exists(cache_dir):
        raise CacheNotFoundError(
            f"{cache_dir!r} does not exist; give the folder a `shardcache build --output` wrote"
        )
    if not os.path.isdir(cache_dir):
        raise CacheNotFoundError(
            f"{cache_dir!r} is a file, not a cache folder; give the folder a `shardcache build "
            "--output` wrote"
        )
    if not os.path.isfile(path):
        running = running_build(cache_dir)
        if running is not None:
            raise CacheNotFoundError(f"{cache_dir!r} holds no committed cache yet: {running}")
        hint = (
            " (a build was started there but never committed; rerun the build)"
            if os.path.isdir(os.path.join(cache_dir, PARTS_DIR))
            else ""
        )
        raise CacheNotFoundError(
            f"{cache_dir!r} holds no shardcache cache: {MANIFEST} is missing{hint}; "
            "build one with `shardcache build`"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as err:
        raise CorruptShardError(f"{path}: cannot read the manifest: {err}") from err
    return validate_manifest(parse_manifest_text(text, path), path)
