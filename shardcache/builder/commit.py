"""Commit: gather the completion records into the length index, quarantine and manifest.

:func:`commit` reads only ``parts/`` (never worker memory), which is what makes resume work,
and writes ``manifest.json`` last and atomically: a reader sees a whole cache or none. Commit
streams the length index and the quarantine file part by part. :func:`commit_output` is
``shardcache commit OUTPUT`` for job arrays: it rebuilds the plan from ``parts/build.json``,
checks that every partition is present (naming the shares that still have to run) and commits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from shardcache.builder.bucket import bucket_ranges
from shardcache.builder.compact import Compacted, Group, compact, plan_compaction
from shardcache.builder.encoders import EncoderFactory, encoder_for
from shardcache.builder.keying import (
    compute_key,
    data_component_from_files,
    data_component_from_version,
)
from shardcache.builder.lock import BuildLock, pid_alive
from shardcache.builder.partition import kill_point
from shardcache.builder.plan import (
    BuildPlan,
    PartitionResult,
    completed_in_store,
    completed_result,
    options_from_json,
    options_json,
    plan_from_json,
)
from shardcache.builder.remote import OutputStore
from shardcache.builder.report import BuildReport, report_from_manifest
from shardcache.builder.sources import (
    InputFile,
    field_hint,
)
from shardcache.builder.tokenize import TextEncoder, TruncationStats
from shardcache.errors import (
    CacheError,
    IncompleteBuildError,
    ShardcacheError,
    SourceError,
)
from shardcache.store.files import (
    concat_files_atomic,
    read_json_or_none,
    sha256_file,
    write_json_atomic,
    write_npy_concat_atomic,
)
from shardcache.store.layout import (
    BUILD_STATE,
    FORMAT_VERSION,
    INDEX_DIR,
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    QUARANTINE,
    SHARD_DIR,
    SHARD_NAME,
    SHARES_DIR,
)
from shardcache.store.manifest import read_manifest
from shardcache.store.remote import is_url
from shardcache.version import __version__


def commit(
    plan: BuildPlan,
    results: list[PartitionResult],
    encoder: TextEncoder,
    compacted: Compacted | None = None,
) -> dict:
    """Join partial shards (:mod:`.compact`), write the length index, the quarantine file
    and, last, the manifest; then remove the shards the merged ones replace.

    ``results`` must be in partition-id order; everything is read from ``parts/``.
    ``compacted``: the shards already joined (a URL output committed from a scratch folder,
    :func:`commit_into_store`), else they are joined here.
    """
    options = plan.options
    out = options.output
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
    parts = os.path.join(out, PARTS_DIR)
    q_bytes, q_sha, q_lines = concat_files_atomic(
        os.path.join(out, QUARANTINE),
        [os.path.join(parts, f"{r.partition}.quarantine.jsonl") for r in results],
    )
    kill_point("commit")

    stats = TruncationStats()
    bad: Counter[str] = Counter()
    per_file: dict[str, dict[str, Any]] = {}
    for r in results:
        stats.add(r.stats)
        bad.update(r.bad_records)
        entry = per_file.setdefault(r.source, {"sha256": "", "documents": 0, "bad_records": 0})
        entry["sha256"] = entry["sha256"] or r.sha256
        entry["documents"] += r.stats.documents
        entry["bad_records"] += sum(r.bad_records.values())
    check_bad_records(plan, stats, bad)
    if compacted is None:
        layout = options.layout
        groups = plan_groups_of(plan, results, encoder)
        compacted = compact(out, groups, layout.compression, layout.shard_size_bytes)
    lengths_path = os.path.join(out, LENGTHS_FILE)
    write_npy_concat_atomic(lengths_path, compacted.lengths)
    kill_point("commit")
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
    manifest = {
        "format_version": FORMAT_VERSION,
        "shardcache_version": __version__,
        "kind": "text" if options.chat is None else "chat",
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
        "index": {
            "lengths": {
                "name": LENGTHS_FILE,
                "bytes": os.path.getsize(lengths_path),
                "sha256": sha256_file(lengths_path),
            }
        },
        "quarantine": {"name": QUARANTINE, "bytes": q_bytes, "sha256": q_sha, "records": q_lines},
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
    write_json_atomic(os.path.join(out, MANIFEST), manifest)
    kill_point("committed")
    for name in compacted.joined:  # after the commit point: until it, partitions stay whole
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, SHARD_DIR, name))
    return manifest


def unlisted_shards(names: list[str], manifest: Mapping[str, Any]) -> list[str]:
    """The shard files among ``names`` that the committed ``manifest`` does not list: the
    partition shards a merged one replaced, left behind when a commit died between writing
    its manifest and removing them. No reader opens them; they only take space."""
    listed = {entry["name"] for entry in manifest["shards"]}
    return sorted(n for n in names if SHARD_NAME.fullmatch(n) and n not in listed)


def remove_unlisted_shards(out: str, manifest: Mapping[str, Any]) -> list[str]:
    """Finish a committed local cache: remove :func:`unlisted_shards` (call it holding the
    build lock); returns their names."""
    folder = os.path.join(out, SHARD_DIR)
    stray = unlisted_shards(os.listdir(folder) if os.path.isdir(folder) else [], manifest)
    for name in stray:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    return stray


def plan_groups_of(
    plan: BuildPlan, results: list[PartitionResult], encoder: TextEncoder
) -> list[Group]:
    """How :func:`commit` joins the partitions' shards (:func:`.compact.plan_compaction`)."""
    itemsize = encoder.dtype.itemsize
    return plan_compaction(plan.options.output, results, plan.options.layout.shard_size_bytes,
                           itemsize)  # fmt: skip


#: Reasons that are not records (a blank line) do not count towards ``max_bad_fraction``.
_NOT_RECORDS = ("blank_line",)


def check_bad_records(plan: BuildPlan, stats: TruncationStats, bad: Mapping[str, int]) -> None:
    """Refuse to commit a build that kept no document, or whose bad records exceed
    ``max_bad_fraction`` of its records: a wrong ``--text-field`` or chat data built as text
    must not end as an empty cache with exit 0. The partitions stay (a rerun with a higher
    ``--max-bad-fraction`` commits them)."""
    options = plan.options
    n_bad = sum(n for reason, n in bad.items() if reason not in _NOT_RECORDS)
    records = stats.documents + n_bad
    if stats.documents and n_bad <= options.max_bad_fraction * records:
        return
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    field = options.chat.messages_field if options.chat else options.source.text_field
    hint = ""
    if {"no_text_field", "no_messages_field"} & set(bad):
        hint = field_hint(plan.inputs, field, "chat" if options.chat else "text")
    hint = f"; {hint}" if hint else ""
    where = f"see {os.path.join(options.output, QUARANTINE)}"
    if not stats.documents:
        raise SourceError(
            f"build kept no document: all {records} records of {len(plan.inputs)} input file(s) "
            f"are bad ({reasons or 'the inputs hold no record'}){hint}; {where}. Nothing was "
            "committed: fix the options (a changed option needs --force) or the input"
        )
    raise SourceError(
        f"build: {n_bad} of {records} records ({n_bad / records:.1%}) are bad, more than "
        f"--max-bad-fraction {options.max_bad_fraction:g} ({reasons}){hint}; {where}. Nothing "
        "was committed (the built partitions are kept): fix the input, or allow it by rerunning "
        f"the same command with --max-bad-fraction {min(1.0, n_bad / records + 0.005):.2f}"
    )


def encoder_summary(results: list[PartitionResult]) -> dict[str, Any]:
    """The manifest's ``encoder`` field, from the partitions' records (so a job-array commit
    and a local build agree): the gate's decision, the backends used, documents verified
    against HF, mismatches and partitions re-encoded with HF."""
    encodings = [r.encoding for r in results if r.encoding]
    backends = Counter(e["backend"] for e in encodings)
    return {
        "requested": sorted({e["requested"] for e in encodings}),
        "gate": sorted({e["gate"] for e in encodings}),
        "partitions_by_backend": dict(sorted(backends.items())),
        "versions": sorted({f"{e['backend']} {e['version']}" for e in encodings}),
        "documents_verified": sum(int(e["verified"]) for e in encodings),
        "mismatches": sum(int(e["mismatches"]) for e in encodings),
        "partitions_reencoded": sorted(r.partition for r in results if r.encoding.get("reencoded")),
        "mismatch_detail": [d for e in encodings for d in e["detail"]][:5],
    }


def owner_hint(out: str, positions: list[int]) -> str:
    counts = set()
    folder = os.path.join(out, SHARES_DIR)
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            data = read_json_or_none(os.path.join(folder, name)) if name.endswith(".json") else None
            if data and isinstance(data.get("shares"), int):
                counts.add(data["shares"])
    return owners_of(counts, positions)


def owners_of(counts: set[int], positions: list[int]) -> str:
    """Which shares own the partitions at ``positions``, when the shares agree on N."""
    if len(counts) == 1:
        n = counts.pop()
        owners = sorted({k % n for k in positions})
        return f"; they belong to share(s) {', '.join(f'{i}/{n}' for i in owners)}: run those"
    return "; partition index k belongs to share k % N of `--partition i/N`: run the missing shares"


def commit_output(
    output: str,
    encoder_factory: EncoderFactory | None = None,
    shard_sizes: Mapping[str, int] | None = None,
    strict_lint: bool = False,
    max_bad_fraction: float | None = None,
) -> BuildReport:
    """``shardcache commit OUTPUT``: write the manifest once every partition is present
    (``strict_lint``: refuse, as ``build --strict-lint`` does, when the chat lint found any
    problem in the shares' partitions; ``max_bad_fraction``: as ``build --max-bad-fraction``).

    ``OUTPUT`` is a folder or a URL. Raises :class:`IncompleteBuildError` listing the
    missing partitions (and their shares) when some are not built yet. Idempotent: a
    committed output is reported as it is.
    """
    if is_url(output):
        return commit_store_output(output, encoder_factory, strict_lint, max_bad_fraction)
    started = time.perf_counter()
    if os.path.isfile(os.path.join(output, MANIFEST)):
        manifest = read_manifest(output)
        with BuildLock(output):  # a commit that died after its manifest: finish it
            remove_unlisted_shards(output, manifest)
        return report_from_manifest(output, manifest, 0.0, up_to_date=True)
    state = read_json_or_none(os.path.join(output, PARTS_DIR, BUILD_STATE))
    if state is None:
        raise CacheError(
            f"{output!r} holds no build to commit ({PARTS_DIR}/{BUILD_STATE} is missing); run "
            "`shardcache build ... --partition i/N` for every share first"
        )
    options = dataclasses.replace(
        options_from_json(state["options"], output), strict_lint=strict_lint
    )
    if max_bad_fraction is not None:
        options = dataclasses.replace(options, max_bad_fraction=max_bad_fraction)
    inputs = [InputFile("", f["relpath"], int(f["size"]), f["format"]) for f in state["inputs"]]
    plan = plan_from_json(state, options, inputs)
    with BuildLock(output):
        if shard_sizes is None:
            folder = os.path.join(output, SHARD_DIR)
            names = os.listdir(folder) if os.path.isdir(folder) else []
            shard_sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
        results: list[PartitionResult] = []
        missing: list[tuple[int, str]] = []
        for k, p in enumerate(plan.partitions):
            result = completed_result(output, p, shard_sizes)
            if result is None:
                missing.append((k, p.id))
            else:
                results.append(result)
        if missing:
            raise _incomplete(output, plan, missing, owner_hint(output, [m[0] for m in missing]))
        encoder = encoder_for(options, encoder_factory)
        listed = {s.name for r in results for s in r.shards}
        folder = os.path.join(output, SHARD_DIR)
        if os.path.isdir(folder):
            for name in os.listdir(folder):  # half-written leftovers of killed shares
                if name not in listed:
                    os.remove(os.path.join(folder, name))
        shutil.rmtree(os.path.join(output, SHARES_DIR), ignore_errors=True)
        os.makedirs(os.path.join(output, "index"), exist_ok=True)
        manifest = commit(plan, results, encoder)
    return report_from_manifest(output, manifest, time.perf_counter() - started)


def _incomplete(
    output: str, plan: BuildPlan, missing: list[tuple[int, str]], hint: str
) -> IncompleteBuildError:
    ids = [m[1] for m in missing]
    shown = ", ".join(ids[:20]) + (f" ... ({len(ids)} in all)" if len(ids) > 20 else "")
    return IncompleteBuildError(
        f"{output!r}: cannot commit, {len(ids)} of {len(plan.partitions)} partitions are not "
        f"built: {shown}{hint}, then rerun `shardcache commit`",
        ids,
    )


#: Scratch folders of URL commits: ``<prefix><pid>-<random>`` in the temporary folder.
COMMIT_SCRATCH_PREFIX = "shardcache-commit-"


def sweep_commit_scratch(root: str) -> list[str]:
    """Remove the scratch folders of URL commits that died on this host (their pid is gone:
    a killed commit's ``TemporaryDirectory`` is never cleaned up, and it holds copies of the
    partial shards and the merged ones); returns the paths removed."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            pid = entry.name[len(COMMIT_SCRATCH_PREFIX) :].split("-", 1)[0]
            if not entry.name.startswith(COMMIT_SCRATCH_PREFIX) or not pid.isdigit():
                continue
            if entry.is_dir(follow_symlinks=False) and not pid_alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def commit_into_store(
    store: OutputStore, plan: BuildPlan, results: list[PartitionResult], encoder: TextEncoder
) -> dict:
    """:func:`commit` for a URL output, from the store alone; ``manifest.json`` last.

    The records' small files (length arrays, quarantine lines) and the partial shards that
    are joined (:mod:`.compact`) are fetched into a temporary folder of this process,
    committed there exactly as a local build would, and the merged shards, the length index
    and the quarantine file uploaded; objects no record lists (a killed task's leftovers) and
    the shares' notes are deleted; then the manifest is uploaded, the commit point, and last
    the shards the merged ones replace are deleted. Every step before the manifest is a pure
    function of the records: a commit that died is redone by running it again.
    """
    sweep_commit_scratch(tempfile.gettempdir())
    prefix = f"{COMMIT_SCRATCH_PREFIX}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        for sub in (PARTS_DIR, INDEX_DIR, SHARD_DIR):
            os.makedirs(os.path.join(scratch, sub))
        names = [f"{PARTS_DIR}/{r.partition}.{ext}" for r in results
                 for ext in ("lengths.npy", "quarantine.jsonl")]  # fmt: skip
        store.get([(n, os.path.join(scratch, n)) for n in names])
        local = dataclasses.replace(plan, options=dataclasses.replace(plan.options, output=scratch))
        groups = plan_groups_of(local, results, encoder)
        joining = [g for g in groups if g.name is not None]
        members = [f"{SHARD_DIR}/{m.name}" for g in joining for m in g.members]
        store.get([(n, os.path.join(scratch, n)) for n in members])
        layout = plan.options.layout
        compacted = compact(scratch, groups, layout.compression, layout.shard_size_bytes)
        manifest = commit(local, results, encoder, compacted)
        listed = {s.name for r in results for s in r.shards}
        store.remove([f"{SHARD_DIR}/{n}" for n in store.sizes(SHARD_DIR) if n not in listed])
        keep = {f"{r.partition}.{ext}" for r in results
                for ext in ("json", "lengths.npy", "quarantine.jsonl")} | {BUILD_STATE}  # fmt: skip
        store.remove([f"{PARTS_DIR}/{n}" for n in store.sizes(PARTS_DIR) if n not in keep])
        store.remove_folders([SHARES_DIR])
        merged = [f"{SHARD_DIR}/{g.name}" for g in joining]
        store.put([(os.path.join(scratch, n), n) for n in (*merged, LENGTHS_FILE, QUARANTINE)])
        kill_point("commit")
        store.put([(os.path.join(scratch, MANIFEST), MANIFEST)])  # last: the commit point
        kill_point("committed")
        store.remove([f"{SHARD_DIR}/{n}" for n in compacted.joined])
    return manifest


def commit_store_output(
    url: str,
    encoder_factory: EncoderFactory | None = None,
    strict_lint: bool = False,
    max_bad_fraction: float | None = None,
) -> BuildReport:
    """``shardcache commit URL``: commit the records found in the store (any machine)."""
    started = time.perf_counter()
    store = OutputStore(url)
    manifest = store.read_json(MANIFEST)
    if manifest is not None:  # a commit that died after its manifest: finish it
        store.remove(
            [f"{SHARD_DIR}/{n}" for n in unlisted_shards(list(store.sizes(SHARD_DIR)), manifest)]
        )
        return report_from_manifest(store.url, manifest, 0.0, up_to_date=True)
    state = store.read_json(f"{PARTS_DIR}/{BUILD_STATE}")
    if state is None:
        raise CacheError(
            f"{store.url!r} holds no build to commit ({PARTS_DIR}/{BUILD_STATE} is missing); "
            "run `shardcache build ... --partition i/N` for every share first"
        )
    options = dataclasses.replace(
        options_from_json(state["options"], store.url), strict_lint=strict_lint
    )
    if max_bad_fraction is not None:
        options = dataclasses.replace(options, max_bad_fraction=max_bad_fraction)
    inputs = [InputFile("", f["relpath"], int(f["size"]), f["format"], f.get("mtime_ns"))
              for f in state["inputs"]]  # fmt: skip
    plan = plan_from_json(state, options, inputs)
    done = completed_in_store(store, plan.partitions)
    missing = [(k, p.id) for k, p in enumerate(plan.partitions) if p.id not in done]
    if missing:
        counts = set()
        for name in store.sizes(SHARES_DIR):
            data = store.read_json(f"{SHARES_DIR}/{name}") if name.endswith(".json") else None
            if data and isinstance(data.get("shares"), int):
                counts.add(data["shares"])
        raise _incomplete(store.url, plan, missing, owners_of(counts, [m[0] for m in missing]))
    encoder = encoder_for(options, encoder_factory)
    manifest = commit_into_store(store, plan, [done[p.id] for p in plan.partitions], encoder)
    return report_from_manifest(store.url, manifest, time.perf_counter() - started)
