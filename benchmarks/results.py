"""The one results file of the benchmarks: a JSON line per run, with machine, versions and date.

Every benchmark script ends with :func:`record_result`, which appends one line to
``benchmarks/results.jsonl`` (or to the file named by ``SHARDCACHE_BENCH_RESULTS``; set it to
an empty string to record nothing, e.g. for a smoke run)::

    {"benchmark": "bench_read", "date": "2026-12-03T09:12:00+00:00",
     "machine": {"platform": ..., "cpu": ..., "cores": 2, "memory_gib": 24.0, "gpu": null},
     "versions": {"shardcache": "0.1.0", "commit": "e9d1e8a", "dirty": false, "python": ...,
                  "torch": ..., "numpy": ..., ...},
     "args": {...the script's options...}, "figures": {...what it measured...}}

The current figures of a benchmark are its last line; older lines are its history. Figures
live here, never in code comments or docstrings.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PATH = os.path.join(HERE, "results.jsonl")
PACKAGES = ("shardcache", "torch", "numpy", "pyarrow", "tokenizers", "transformers", "numba",
            "fastokens", "datasets", "ray", "s3fs")  # fmt: skip


def results_path() -> str | None:
    """Where results go: ``SHARDCACHE_BENCH_RESULTS`` if set (empty: nowhere), else
    ``benchmarks/results.jsonl``."""
    path = os.environ.get("SHARDCACHE_BENCH_RESULTS")
    if path is None:
        return DEFAULT_PATH
    return path or None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpu() -> str | None:
    if "torch" not in sys.modules:  # never import torch only to describe the machine
        return None
    torch = sys.modules["torch"]
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on."""
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpu": _gpu(),
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True,
                             timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def versions() -> dict[str, Any]:
    """The code and the libraries a benchmark ran with (a library not installed is absent)."""
    found: dict[str, Any] = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        found["commit"] = commit
        found["dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return found


def record_result(
    benchmark: str, figures: dict[str, Any], args: Any = None, path: str | None = None
) -> dict[str, Any]:
    """Append one run's figures to the results file and return the line written.

    Args:
        benchmark: the script's name, e.g. ``"bench_read"``.
        figures: what the run measured (JSON-able: numbers, strings, lists, dicts), with the
            units in the keys (``seconds``, ``tokens_per_s``, ``peak_rss_mib``).
        args: the script's options (an ``argparse.Namespace`` or a dict), to say what ran.
        path: the results file; default :func:`results_path`.

    Returns:
        The record, also when nothing is written (``SHARDCACHE_BENCH_RESULTS=""``).
    """
    if args is not None and not isinstance(args, dict):
        args = vars(args)
    record = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "args": {k: v for k, v in (args or {}).items() if not callable(v)},
        "figures": figures,
    }
    target = path if path is not None else results_path()
    if target:
        line = json.dumps(record, default=str, sort_keys=False)
        with open(target, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        print(f"results: appended to {target}", file=sys.stderr)
    return record
