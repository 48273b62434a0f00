"""Builds from and into object storage: stage locally, upload, manifest last.

Write side: **stage, then upload, manifest last.** A build whose ``--output`` is a URL builds
into a local staging folder (``$SHARDCACHE_CACHE_DIR/staging/<hash of the URL>``), exactly as
a local build would (same bytes), then uploads ``shards/``, ``parts/``, ``index/`` and the
quarantine file, and ``manifest.json`` last: the manifest's presence is the commit on an
object store too, where there is no rename. A killed build resumes from its staging folder
(same machine); an upload that failed after the staged commit is redone by rerunning. The
staging folder is deleted after a successful upload. A job-array share (``--partition i/N``)
uploads its partitions' files; ``shardcache commit URL`` downloads ``parts/`` (small: records,
length arrays, quarantine lines), checks the shards' sizes with one listing, commits in a
staging folder and uploads the index, the quarantine file and the manifest.

Inputs given as URLs are downloaded into ``$SHARDCACHE_CACHE_DIR/inputs/`` before the plan
(the split into byte ranges needs seeks; a download is sequential, one pass). Each keeps its
path relative to the common prefix of the URLs and its size, and gets the object's
modification time, so the manifest's per-file relpath / size / sha256 and the resume
fingerprint are those of a local build of the same files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any

from shardcache.build.report import report_from_manifest
from shardcache.build.sources import InputFile, detect_format
from shardcache.config import BuildOptions
from shardcache.errors import CacheError, ConfigError, SourceError
from shardcache.store.layout import (
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    QUARANTINE,
    SHARD_DIR,
    SHARES_DIR,
    check_relative_name,
)
from shardcache.store.manifest import read_manifest
from shardcache.store.remote import (
    cache_root,
    download,
    filesystem,
    is_url,
    staging_dir,
    upload_tree,
    url_digest,
)


def _mtime_ns(fs: Any, path: str, info: dict[str, Any]) -> int:
    with contextlib.suppress(Exception):
        return int(fs.modified(path).timestamp() * 1e9)
    for key in ("mtime", "LastModified", "last_modified"):
        if key in info:
            value = info[key]
            return int((value.timestamp() if hasattr(value, "timestamp") else float(value)) * 1e9)
    return 0


def stage_inputs(specs: tuple[str, ...]) -> list[InputFile]:
    """Download URL inputs (files, folders/prefixes or globs) into the local cache folder.

    Returns input files whose ``relpath`` is relative to the URLs' common prefix (as a local
    listing would make it), ``size`` the object's, and whose local copy carries the object's
    modification time (so a resumed build's fingerprint matches).
    """
    found: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec in specs:
        if not is_url(spec):
            raise ConfigError(
                f"inputs: {spec!r} is a local path among URL inputs; give all inputs as URLs "
                "or all as local paths"
            )
        fs, path = filesystem(spec)
        try:
            if any(ch in path for ch in "*?["):
                listed = fs.glob(path, detail=True)
                if not listed:
                    raise SourceError(f"input {spec!r}: the pattern matches no object")
            elif fs.isdir(path):
                listed = {p: i for p, i in fs.find(path, detail=True).items()
                          if detect_format(p)}  # fmt: skip
                if not listed:
                    raise SourceError(f"input {spec!r}: the prefix holds no input file")
            else:
                listed = {path: fs.info(path)}
        except FileNotFoundError as err:
            raise SourceError(f"input {spec!r}: no such object or prefix ({err})") from err
        for p, info in listed.items():
            if info.get("type") == "directory":
                continue
            if detect_format(p) is None:
                raise SourceError(f"input {fs.unstrip_protocol(p)!r}: unknown format")
            found[fs.unstrip_protocol(p)] = (fs, p, info)
    if not found:
        raise SourceError(f"inputs {list(specs)}: no input file found")
    root = os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in found])
    folder = os.path.join(cache_root(), "inputs")
    files = []
    for url, (fs, p, info) in sorted(found.items()):
        relpath = os.path.relpath(url.split("://", 1)[1], root).replace(os.sep, "/")
        size = int(info.get("size") or 0)
        mtime = _mtime_ns(fs, p, info)
        local = os.path.join(folder, url_digest(f"{url}|{size}|{mtime}"), os.path.basename(p))
        if not os.path.isfile(local) or os.path.getsize(local) != size:
            download(fs, p, local, None, size)
            os.utime(local, ns=(mtime, mtime))
        fmt = detect_format(p) or ""
        files.append(InputFile(local, relpath, size, fmt, os.stat(local).st_mtime_ns))
    files.sort(key=lambda f: f.relpath)
    return files


def build_remote(
    options: BuildOptions,
    build_local: Callable[[BuildOptions, list[InputFile] | None], Any],
    share_tag: str = "",
) -> Any:
    """Build with URL inputs and/or a URL output: stage, build locally, upload, manifest last.

    ``build_local(options, inputs)`` runs the ordinary build (or a share) on local paths and
    returns its report.
    """
    remote_inputs = any(map(is_url, options.source.inputs))
    inputs = stage_inputs(options.source.inputs) if remote_inputs else None
    if not is_url(options.output):
        return build_local(options, inputs)
    url = options.output.rstrip("/")
    fs, root = filesystem(url)
    stage = staging_dir(url, share_tag)
    if fs.exists(f"{root}/{MANIFEST}"):
        if not options.force or share_tag:
            raise CacheError(
                f"{url!r} already holds a committed cache; pass --force to rebuild it (not "
                "with --partition: delete the prefix first), or choose another --output"
            )
        fs.rm_file(f"{root}/{MANIFEST}")  # first: readers stop seeing the old cache
        fs.invalidate_cache()
    if os.path.isfile(os.path.join(stage, MANIFEST)) and not options.force:
        report = _staged_report(stage)  # committed here, upload interrupted: redo the upload
    else:
        report = build_local(dataclasses.replace(options, output=stage), inputs)
    upload_tree(stage, url, with_manifest=os.path.isfile(os.path.join(stage, MANIFEST)))
    shutil.rmtree(stage, ignore_errors=True)
    if inputs:
        for f in inputs:
            shutil.rmtree(os.path.dirname(f.path), ignore_errors=True)
    if hasattr(report, "output"):
        report.output = url
    return report


def _staged_report(stage: str) -> Any:
    return report_from_manifest(stage, read_manifest(stage), 0.0)


def commit_remote(url: str, commit_local: Callable[[str, dict[str, int]], Any]) -> Any:
    """``shardcache commit URL``: fetch ``parts/``, commit in a staging folder, upload."""
    url = url.rstrip("/")
    fs, root = filesystem(url)
    stage = staging_dir(url, "commit")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(os.path.join(stage, PARTS_DIR))
    fs.invalidate_cache()
    if fs.exists(f"{root}/{MANIFEST}"):
        fs.get_file(f"{root}/{MANIFEST}", os.path.join(stage, MANIFEST))
    for sub in (PARTS_DIR, SHARES_DIR):
        with contextlib.suppress(FileNotFoundError):
            for rpath in fs.find(f"{root}/{sub}"):
                rel = rpath[len(root) + 1 :]
                if rel.endswith((".lock", ".tmp")):
                    continue
                # a listed key such as parts/../../x must not become a path outside the stage
                local = os.path.join(stage, check_relative_name(rel, f"object {rpath!r}"))
                os.makedirs(os.path.dirname(local), exist_ok=True)
                fs.get_file(rpath, local)
    sizes: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for rpath, info in fs.find(f"{root}/{SHARD_DIR}", detail=True).items():
            sizes[rpath.rsplit("/", 1)[-1]] = int(info["size"])
    already = os.path.isfile(os.path.join(stage, MANIFEST))
    result = commit_local(stage, sizes)
    if not already:
        names = [LENGTHS_FILE, QUARANTINE]
        fs.put([os.path.join(stage, n) for n in names], [f"{root}/{n}" for n in names])
        fs.put_file(os.path.join(stage, MANIFEST), f"{root}/{MANIFEST}")
        fs.invalidate_cache()
    shutil.rmtree(stage, ignore_errors=True)
    return result
