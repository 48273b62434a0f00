"""An epoch plan computed once per machine and memory-mapped by every process that needs it.

One process computes under an exclusive ``flock`` while the others wait, then read the ``.npy``
files; files that do not match their recorded sha256s are computed again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable

import numpy as np

from shardcache.read.plan.epoch_plan import EpochPlan
from shardcache.store.files import (
    cache_root,
    exclusive_lock,
    private_tmp,
    read_json_or_none,
    sha256_file,
    sha256_text,
    write_json_atomic,
    write_npy_atomic,
)

PLAN_FILE_VERSION = 3
#: In a stored plan's folder: array file name -> its sha256.
DIGESTS_FILE = "sha256.json"
PLANS_DIR = "plans"
#: Below this many sequences a plan is recomputed (milliseconds), not written.
SHARE_MIN_SEQUENCES = 200_000
#: Plans kept in the folder (a few epochs of a few option sets).
KEEP_PLANS = 8
_FIELDS = (
    "batch_offsets",
    "sample_ids",
    "row_offsets",
    "seg_starts",
    "seg_lengths",
    "repeats",
)


def plan_digest(data_identity: str, options_json: str, seed: int, epoch: int) -> str:
    """The name of a stored plan: a digest of everything the plan is a function of."""
    return sha256_text(f"{PLAN_FILE_VERSION}|{data_identity}|{options_json}|{seed}|{epoch}")


def _matches_digests(folder: str) -> bool:
    """Whether ``folder`` holds exactly the array files its ``DIGESTS_FILE`` lists, unchanged."""
    try:
        recorded = read_json_or_none(os.path.join(folder, DIGESTS_FILE))
        present = {n for n in os.listdir(folder) if n.endswith(".npy")}
        if not isinstance(recorded, dict) or set(recorded) != present:
            return False
        return all(sha256_file(os.path.join(folder, n)) == recorded[n] for n in sorted(present))
    except OSError:
        return False


def _read(folder: str) -> EpochPlan | None:
    if not _matches_digests(folder):
        return None
    arrays: dict[str, np.ndarray | None] = {}
    try:
        for name in _FIELDS:
            path = os.path.join(folder, f"{name}.npy")
            arrays[name] = (
                np.load(path, mmap_mode="r", allow_pickle=False) if os.path.exists(path) else None
            )
    except (OSError, ValueError):
        return None
    if arrays["batch_offsets"] is None or arrays["sample_ids"] is None:
        return None
    with contextlib.suppress(OSError):
        os.utime(folder)  # most recently used
    return EpochPlan(**arrays)  # type: ignore[arg-type]


def _write(folder: str, plan: EpochPlan) -> None:
    tmp = private_tmp(folder)
    os.makedirs(tmp)
    try:
        digests = {}
        for name in _FIELDS:
            value = getattr(plan, name)
            if value is not None:
                path = os.path.join(tmp, f"{name}.npy")
                write_npy_atomic(path, np.asarray(value))
                digests[f"{name}.npy"] = sha256_file(path)
        write_json_atomic(os.path.join(tmp, DIGESTS_FILE), digests)
        shutil.rmtree(folder, ignore_errors=True)  # a damaged plan: replaced
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _evict(root: str, keep: str) -> None:
    entries = []
    with os.scandir(root) as it:
        for entry in it:
            if entry.is_dir() and not entry.name.endswith(".tmp") and entry.path != keep:
                with contextlib.suppress(OSError):
                    entries.append((entry.stat().st_mtime_ns, entry.path))
    for _, path in sorted(entries)[: max(len(entries) - (KEEP_PLANS - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)  # lock files stay: a waiter may hold one


def shared_plan(digest: str, num_sequences: int, compute: Callable[[], EpochPlan]) -> EpochPlan:
    """``compute()``'s plan, computed once per machine; small plans are computed in place."""
    if num_sequences < SHARE_MIN_SEQUENCES:
        return compute()
    try:
        root = os.path.join(cache_root(), PLANS_DIR)
        os.makedirs(root, exist_ok=True)
    except OSError:
        return compute()  # no writable folder: every process plans for itself
    folder = os.path.join(root, digest)
    # one process computes, the others wait on the lock and read what it stored
    with exclusive_lock(os.path.join(root, f"{digest}.lock")) as locked:
        if not locked:
            return compute()
        plan = _read(folder) if os.path.isdir(folder) else None
        if plan is not None:
            return plan
        plan = compute()
        with contextlib.suppress(OSError):
            _write(folder, plan)
            _evict(root, keep=folder)
        return plan


def _counts_path(digest: str) -> str:
    # (".counts2": each stream's block counts and splittable counts; an older process's
    # ".counts.json" holds counts alone and is never read as these)
    return os.path.join(cache_root(), PLANS_DIR, f"{digest}.counts2.json")


def read_counts(digest: str) -> dict[int, np.ndarray] | None:
    """Stream batch counts another process of this machine stored, or None."""
    try:
        data = read_json_or_none(_counts_path(digest))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        return None
    try:
        counts = {int(k): np.asarray(v, dtype=np.int64) for k, v in data.items()}
    except (TypeError, ValueError):
        return None
    if not all(c.ndim == 2 and c.shape[0] == 2 for c in counts.values()):
        return None
    return counts


def write_counts(digest: str, counts: dict[int, np.ndarray]) -> None:
    """Store stream batch counts for the other processes of this machine (best effort)."""
    with contextlib.suppress(OSError):
        os.makedirs(os.path.join(cache_root(), PLANS_DIR), exist_ok=True)
        write_json_atomic(_counts_path(digest), {str(k): v.tolist() for k, v in counts.items()})
