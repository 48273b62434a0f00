"""Commit: gather the completion records into the length index, quarantine and manifest.

Reads only ``parts/`` records (never worker memory), so resume and job arrays commit alike;
``manifest.json`` is published last, so a reader sees a whole cache or none. A commit that
dies is redone by running it again.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from shardcache.builder.bucket import bucket_ranges
from shardcache.builder.build_plan import (
    BuildPlan,
    PartitionResult,
    completed,
    options_from_json,
    options_json,
    plan_from_json,
)
from shardcache.builder.compact import MAX_MERGE_THREADS, Compacted, compact, plan_compaction
from shardcache.builder.encoders import Encoder, EncoderFactory, encoder_for
from shardcache.builder.fault_points import fault_point
from shardcache.builder.key_computation import (
    compute_key,
    data_component_from_files,
    data_component_from_version,
)
from shardcache.builder.report import BuildReport, report_from_manifest
from shardcache.builder.sources import InputFile, field_hint
from shardcache.builder.tokenize import TruncationStats
from shardcache.errors import (
    CacheError,
    IncompleteBuildError,
    ShardcacheError,
    SourceError,
)
from shardcache.store.build_lock import sweep_dead_scratch
from shardcache.store.files import (
    concat_files_atomic,
    sha256_file,
    write_json_atomic,
    write_npy_concat_atomic,
)
from shardcache.store.layout import (
    BUILD_STATE,
    CONTENT_KEYS_FILE,
    FORMAT_VERSION,
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    QUARANTINE,
    SHARD_DIR,
    SHARD_NAME,
    SHARES_DIR,
)
from shardcache.store.manifest import parse_manifest_text
from shardcache.store.storage import Storage, open_storage
from shardcache.version import __version__

#: The manifest's ``index`` entries and their files.
INDEX_FILES = {"lengths": LENGTHS_FILE, "content_keys": CONTENT_KEYS_FILE}
#: Scratch folders of URL commits: ``<prefix><pid>-<random>`` in the temporary folder.
COMMIT_SCRATCH_PREFIX = "shardcache-commit-"


def commit(
    storage: Storage, plan: BuildPlan, results: list[PartitionResult], encoder: Encoder
) -> dict[str, Any]:
    """Join partial shards, write the length index, the quarantine file and, last, the manifest.

    Files no record lists (a killed task's leftovers) and the shares' notes are deleted before the
    manifest is published; the shards that merged ones replace only after it, so partitions stay
    whole until the commit point.
    """
    options = plan.options
    lint: Counter[str] = Counter()
    for r in results:
        lint.update(r.lint)
    problems = {k: v for k, v in sorted(lint.items()) if v and k != "template_checked"}
    if options.strict_lint and problems:
        raise ShardcacheError(
            f"chat lint found problems with --strict-lint: {problems}; the cache was not "
            "committed (the partitions are kept). Fix the template/data, or rerun without "
            "--strict-lint to commit anyway (see `shardcache info` for the counts)"
        )
    sweep_dead_scratch(tempfile.gettempdir())
    with storage.staging(f"commit-{os.getpid()}") as out:  # see COMMIT_SCRATCH_PREFIX
        staged = [f"{PARTS_DIR}/{r.partition}.{ext}" for r in results
                  for ext in ("lengths.npy", "content_keys.npy", "quarantine.jsonl")]  # fmt: skip
        storage.fetch(out, staged)
        q_bytes, q_sha, q_lines = concat_files_atomic(
            os.path.join(out, QUARANTINE),
            [os.path.join(out, PARTS_DIR, f"{r.partition}.quarantine.jsonl") for r in results],
        )
        fault_point("commit")
        stats = TruncationStats()
        bad: Counter[str] = Counter()
        per_file: dict[str, dict[str, Any]] = {}
        for r in results:
            stats.add(r.stats)
            bad.update(r.bad_records)
            for part in r.per_file():
                entry = per_file.setdefault(part["source"], {"sha256": "", "documents": 0,
                                                             "bad_records": 0})  # fmt: skip
                entry["sha256"] = entry["sha256"] or part["sha256"]
                entry["documents"] += part["documents"]
                entry["bad_records"] += part["bad_records"]
        _check_bad_records(plan, stats, bad)
        layout = options.layout
        groups = plan_compaction(out, results, layout.shard_size_bytes, encoder.dtype.itemsize)
        joining = [g for g in groups if g.name is not None]
        storage.fetch(out, [f"{SHARD_DIR}/{m.name}" for g in joining for m in g.members])
        threads = min(options.num_workers, MAX_MERGE_THREADS)
        compacted = compact(out, groups, layout.compression, layout.shard_size_bytes, threads)
        write_npy_concat_atomic(os.path.join(out, LENGTHS_FILE), compacted.lengths)
        write_npy_concat_atomic(os.path.join(out, CONTENT_KEYS_FILE), compacted.content_keys())
        fault_point("commit")
        manifest = _manifest(plan, results, encoder, compacted, per_file, stats, bad, lint)
        manifest["index"] = {key: {"name": name, "bytes": os.path.getsize(os.path.join(out, name)),
                                   "sha256": sha256_file(os.path.join(out, name))}
                             for key, name in INDEX_FILES.items()}  # fmt: skip
        manifest["quarantine"] = {"name": QUARANTINE, "bytes": q_bytes, "sha256": q_sha,
                                  "records": q_lines}  # fmt: skip
        merged = [f"{SHARD_DIR}/{g.name}" for g in joining]
        _remove_unlisted(storage, results, {n.split("/", 1)[1] for n in merged})
        storage.publish(out, [*merged, *INDEX_FILES.values(), QUARANTINE])
        fault_point("commit")
        write_json_atomic(os.path.join(out, MANIFEST), manifest)
        storage.publish(out, [MANIFEST])  # the commit point
        fault_point("committed")
        # after the commit point: until it, partitions stay whole
        storage.remove([f"{SHARD_DIR}/{n}" for n in compacted.joined])
    return manifest


def _manifest(
    plan: BuildPlan,
    results: list[PartitionResult],
    encoder: Encoder,
    compacted: Compacted,
    per_file: Mapping[str, Mapping[str, Any]],
    stats: TruncationStats,
    bad: Mapping[str, int],
    lint: Mapping[str, int],
) -> dict[str, Any]:
    """The manifest's fields (``commit`` adds ``index`` and ``quarantine``)."""
    options = plan.options
    shards = [s.to_json() for s in compacted.shards]
    inputs = [
        {
            "relpath": f.relpath,
            "size": f.size,
            "format": f.format,
            "sha256": plan.file_sha256.get(f.relpath) or per_file[f.relpath]["sha256"],
            "documents": per_file[f.relpath]["documents"],
            "bad_records": per_file[f.relpath]["bad_records"],
        }
        for f in plan.inputs
    ]
    data = (
        data_component_from_version(options.data_version)
        if options.data_version is not None
        else data_component_from_files(inputs)
    )
    return {
        "format_version": FORMAT_VERSION,
        "shardcache_version": __version__,
        "kind": options.kind,
        "options": options_json(options),
        "tokenizer": encoder.describe(),
        "dtype": encoder.dtype.name,
        "buckets": {
            "edges": list(plan.edges),
            "ranges": [list(r) for r in bucket_ranges(plan.edges, options.tokenize.max_length)],
        },
        "key": compute_key(encoder, data).to_json(),
        # soft: which backend produced the ids (never part of the key: ids are proven equal)
        "encoder": encoder_summary(results),
        "inputs": inputs,
        "partitions": len(results),
        "shards": shards,
        "stats": {
            **stats.to_json(),
            "bad_records": dict(sorted(bad.items())),
            "corrupt_files": [c for r in results for c in r.corrupt],
            "lint": dict(sorted(lint.items())),
        },
        "totals": {
            "documents": stats.documents,
            "sequences": stats.sequences,
            "tokens": stats.tokens,
            "shards": len(shards),
            "shard_bytes": sum(s["bytes"] for s in shards),
            "input_bytes": sum(f.size for f in plan.inputs),
        },
    }


def _remove_unlisted(storage: Storage, results: list[PartitionResult], merged: set[str]) -> None:
    """Delete files no record lists but ``merged`` (killed tasks' leftovers), and shares' notes."""
    listed = {s.name for r in results for s in r.shards} | merged
    storage.remove([f"{SHARD_DIR}/{n}" for n in storage.sizes(SHARD_DIR) if n not in listed])
    keep = {f"{r.partition}.{ext}" for r in results
            for ext in ("json", "lengths.npy", "content_keys.npy", "quarantine.jsonl")
            } | {BUILD_STATE}  # fmt: skip
    storage.remove([f"{PARTS_DIR}/{n}" for n in storage.sizes(PARTS_DIR) if n not in keep])
    storage.remove_folders([SHARES_DIR])


def committed_manifest(storage: Storage) -> dict[str, Any] | None:
    """The output's committed manifest (parsed, not validated), or None when it has none."""
    data = storage.read_many([MANIFEST])[MANIFEST]
    if data is None:
        return None
    return parse_manifest_text(data.decode("utf-8", "replace"), f"{storage.location}/{MANIFEST}")


def finish_committed(storage: Storage, manifest: Mapping[str, Any]) -> list[str]:
    """Remove the shard files a committed manifest does not list; return their names.

    A commit that died after its manifest leaves them; call it holding the build lock.
    """
    listed = {entry["name"] for entry in manifest["shards"]}
    stray = sorted(
        n for n in storage.sizes(SHARD_DIR) if SHARD_NAME.fullmatch(n) and n not in listed
    )
    storage.remove([f"{SHARD_DIR}/{n}" for n in stray])
    return stray


#: Reasons that are not records (a blank line) do not count towards ``max_bad_fraction``.
_NOT_RECORDS = ("blank_line",)


def _check_bad_records(plan: BuildPlan, stats: TruncationStats, bad: Mapping[str, int]) -> None:
    """Raise SourceError when no document was kept or bad records exceed ``max_bad_fraction``."""
    options = plan.options
    n_bad = sum(n for reason, n in bad.items() if reason not in _NOT_RECORDS)
    records = stats.documents + n_bad
    if stats.documents and n_bad <= options.max_bad_fraction * records:
        return
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    field = options.chat.messages_field if options.chat else options.source.text_field
    hint = ""
    if {"no_text_field", "no_messages_field"} & set(bad):
        hint = field_hint(plan.inputs, field, options.kind)
    hint = f"; {hint}" if hint else ""
    where = f"see {os.path.join(options.output, QUARANTINE)}"
    if not stats.documents:
        raise SourceError(
            f"build kept no document: all {records} records of {len(plan.inputs)} input file(s) "
            f"are bad ({reasons or 'the inputs hold no record'}){hint}; {where}. Nothing was "
            "committed or kept: fix the options or the input and rerun (no --force needed)"
        )
    raise SourceError(
        f"build: {n_bad} of {records} records ({n_bad / records:.1%}) are bad, more than "
        f"--max-bad-fraction {options.max_bad_fraction:g} ({reasons}){hint}; {where}. Nothing "
        "was committed (the built partitions are kept): fix the input, or allow it by rerunning "
        f"the same command with --max-bad-fraction {min(1.0, n_bad / records + 0.005):.2f}"
    )


def encoder_summary(results: list[PartitionResult]) -> dict[str, Any]:
    """The manifest's ``encoder`` field, from the partitions' records alone."""
    encodings = [r.encoding for r in results if r.encoding]
    backends = Counter(e["backend"] for e in encodings)
    return {
        "requested": sorted({e["requested"] for e in encodings}),
        "gate": sorted({e["gate"] for e in encodings}),
        "partitions_by_backend": dict(sorted(backends.items())),
        "versions": sorted({f"{e['backend']} {e['version']}" for e in encodings}),
        "documents_verified": sum(int(e["verified"]) for e in encodings),
        "tokens_verified": sum(int(e.get("verified_tokens", 0)) for e in encodings),
        "verify_fraction": max((float(e.get("verify_fraction", 0)) for e in encodings), default=0),
        "mismatches": sum(int(e["mismatches"]) for e in encodings),
        "partitions_reencoded": sorted(r.partition for r in results if r.encoding.get("reencoded")),
        "mismatch_detail": [d for e in encodings for d in e["detail"]][:5],
    }


def commit_output(
    output: str,
    encoder_factory: EncoderFactory | None = None,
    strict_lint: bool = False,
    max_bad_fraction: float | None = None,
) -> BuildReport:
    """``shardcache commit OUTPUT``: write the manifest once every partition is present.

    Idempotent: a committed output is finished (``finish_committed``) and reported up to date.
    The options are the recorded ones, but for ``strict_lint`` and (when given)
    ``max_bad_fraction``; IncompleteBuildError names the missing partitions and their shares.
    """
    started = time.perf_counter()
    storage = open_storage(output)
    if committed_manifest(storage) is not None:  # a commit that died after its manifest
        with storage.lock():
            manifest = committed_manifest(storage) or {}
            finish_committed(storage, manifest)
        return report_from_manifest(storage.location, manifest, 0.0, up_to_date=True)
    state = storage.read_json(f"{PARTS_DIR}/{BUILD_STATE}")
    if state is None:
        raise CacheError(
            f"{storage.location!r} holds no build to commit ({PARTS_DIR}/{BUILD_STATE} is "
            "missing); run `shardcache build ... --partition i/N` for every share first"
        )
    options = dataclasses.replace(
        options_from_json(state["options"], storage.location), strict_lint=strict_lint
    )
    if max_bad_fraction is not None:
        options = dataclasses.replace(options, max_bad_fraction=max_bad_fraction)
    inputs = [InputFile("", f["relpath"], int(f["size"]), f["format"], f.get("mtime_ns"))
              for f in state["inputs"]]  # fmt: skip
    plan = plan_from_json(state, options, inputs)
    with storage.lock():
        done = completed(storage, plan.partitions)
        missing = [(k, p.id) for k, p in enumerate(plan.partitions) if p.id not in done]
        if missing:
            raise _incomplete(storage, plan, missing)
        encoder = encoder_for(options, encoder_factory)
        manifest = commit(storage, plan, [done[p.id] for p in plan.partitions], encoder)
    return report_from_manifest(storage.location, manifest, time.perf_counter() - started)


def _incomplete(
    storage: Storage, plan: BuildPlan, missing: list[tuple[int, str]]
) -> IncompleteBuildError:
    counts = set()  # the N of the shares' notes: which share owns a partition, if they agree
    for name in storage.sizes(SHARES_DIR):
        data = storage.read_json(f"{SHARES_DIR}/{name}") if name.endswith(".json") else None
        if data and isinstance(data.get("shares"), int):
            counts.add(data["shares"])
    if len(counts) == 1:
        n = counts.pop()
        owners = ", ".join(f"{i}/{n}" for i in sorted({k % n for k, _ in missing}))
        hint = f"; they belong to share(s) {owners}: run those"
    else:
        hint = "; partition k belongs to share k % N of `--partition i/N`: run the missing shares"
    ids = [m[1] for m in missing]
    shown = ", ".join(ids[:20]) + (f" ... ({len(ids)} in all)" if len(ids) > 20 else "")
    return IncompleteBuildError(
        f"{storage.location!r}: cannot commit, {len(ids)} of {len(plan.partitions)} partitions "
        f"are not built: {shown}{hint}, then rerun `shardcache commit`",
        ids,
    )
