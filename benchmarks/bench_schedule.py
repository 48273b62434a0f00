#!/usr/bin/env python3
"""Schedule benchmark: what a schedule adds to choosing a mixture epoch's documents.

    python benchmarks/bench_schedule.py [--sources 20] [--sequences 1000000] [--phases 3]
    PYTHONPATH=. python benchmarks/bench_schedule.py --part first-batch [--sizes 20M,60M,200M]

``--part window`` (the default):

Synthetic (no files): ``--sources`` sources of ``--sequences`` lognormal lengths each
(median 400, clipped to 4096), a ``--phases``-phase schedule whose weights move between
sources, windows of the size an unscheduled mixture's epoch with the last phase's weights has
(so both sides choose about the same documents), caps high enough for a run of ``8 x phases``
windows. Measures, single process, best of 3, both sides interleaved in each round:

* ``resolve_s``: ``resolve_schedule`` (cutting the run into windows, every source's
  cumulative targets);
* ``window_s``: the documents of the run's last window (``Mixture.documents`` with the
  schedule: every source's position from the targets, no earlier window planned), against
  ``epoch_s``: an unscheduled mixture's epoch of the same size (``Mixture.documents``);
  ``ratio = window_s / epoch_s``. Planning the chosen documents into batches is the same code
  for both (streams or the global plan), so it is not timed here.

Prints one JSON line and appends it to ``benchmarks/results.jsonl`` (``results.py``).

``--part first-batch``: a rank's first batch in a late window at the scale of
``bench_scale.py --part sim`` (whose synthetic length index and shard table it reuses: N
sequences, shards of at most 1000 rows of one bucket, no token data), cut by shards into
``--sources`` sources of about N / sources sequences. A ``--phases``-phase schedule (weights
drawn per phase, ``--phase-windows`` windows a phase, windows as large as an unscheduled epoch
with the last phase's weights, caps high enough) against an unscheduled mixture of the same
sources with the last phase's weights. World size and streams ``--world`` (W = C). For each N,
in one process, rank 0, the window/epoch being the first window of the last phase:

* ``first_batch_s``: from opening the index (lengths memory-mapped, the shard table, every
  mixture id's bucket as ``MixedCache.buckets`` gives it) and resolving the mixture (and the
  schedule) to the sample ids of the rank's first batch: what the window takes of each source
  (``Mixture.epochs``: shard counts and tokens, ``O(shards)``), ``passes.EpochShards``,
  ``StreamLayout``, ``StreamPlan``, ``split_epoch``, as ``ShardDataset`` does; side ``one``:
  one cache of the same documents (its ``ShardIndex``), the reference. Variants: ``given``:
  every stream's batch counts given (what ``prepare()`` or another process of the machine
  leaves); ``prepare``: what ``ShardDataset.prepare()`` then ``plan()`` do on the rank (the
  layout, its own streams' counts, the other ranks' counts given for the exchange, the layout
  again, the plan);
  ``all``: counting every stream's batches itself (no ``prepare()``).
* ``traced_peak_mib``: the peak of tracemalloc (numpy's allocations; the memory-mapped
  lengths are not counted) and ``held_mib`` what is still allocated at the first batch (what
  the rank holds while it reads the epoch: the chosen ids, every id's bucket, the block plans),
  in a first, traced round, which also computes the counts the other
  variants are given. Times are the best of ``--repeats`` later rounds, both sides and all
  variants interleaved in each round; sizes above ``--timed-max`` (and ``all`` above
  ``--all-timed-max``) have the traced round only, marked ``traced``. ``--extrapolate`` sizes
  are linear in N from the largest measured size, marked ``extrapolated``.

``--part point --base TREE [--this TREE]``: a schedule point far into the run, before and
after a change in the same run (``--base``: another checkout, e.g. ``git worktree add
/tmp/base COMMIT``; ``--this``: this one). ``--sources`` sources of 1e9 tokens each, three
points (0, ``at / 2``, ``at``, weights drawn per point), ``total_tokens = 1.5 at``, for each
``at`` of ``--at`` and each case: ``default`` (the default window: every source once at the
first point's shares), ``small`` (``window_tokens=4096``, a batch), ``max`` (the window that
cuts the run into just under 100,000 windows, the most a schedule could have before),
``linear`` (kind linear, the default window) and ``capped`` (``max_repetitions=4``: the run
breaks a cap, the error is the answer). Each measurement runs in a fresh process with its
tree first on ``sys.path``, the two trees alternating, best of ``--repeats``:

* ``resolve_s``: ``resolve_schedule``, then ``table()`` (what ``shardcache mix`` prints), the
  targets of the first window of the last phase and of the run's last window, and
  ``expected_documents`` (what a ``ShardDataset`` asks at construction), untraced;
* ``traced_peak_mib``: tracemalloc's peak over the same calls (a first, traced round);
* ``windows``, or ``error``: the first line of the ``ConfigError`` raised.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np
from results import record_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_scale import BUCKET_EDGES, count, counts, human, load_index, make_index

from shardcache.read.plan.epoch_plan import PlanOptions, split_epoch
from shardcache.read.plan.streams import (
    ShardIndex,
    StreamLayout,
    StreamPlan,
    count_batches,
    own_streams,
)
from shardcache.read.selection.mixture import Mixture, MixtureIndex, Source
from shardcache.read.selection.mixture_table import solve_mixture
from shardcache.read.selection.passes import EpochShards
from shardcache.read.selection.schedule import Schedule, resolve_schedule

REPEATS = 3
#: ``--part point``: one measurement in a fresh process, the tree (argv[1]) first on sys.path
POINT_CHILD = r"""
import json, math, sys, time, tracemalloc
sys.path.insert(0, sys.argv[1])
import numpy as np
from shardcache import ConfigError, Schedule, Source
from shardcache.read.selection.schedule import resolve_schedule
at, case, k = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
names = [f"s{i}" for i in range(k)]
tokens = [10**9] * k
rng = np.random.default_rng(0)
points = [{"at_tokens": x, "weights": dict(zip(names, rng.uniform(0.5, 2.0, k).tolist()))}
          for x in (0, at // 2, at)]
repetitions = 4.0 if case == "capped" else 1e12
sources = tuple(Source(x, name=x, max_repetitions=repetitions) for x in names)
window = {"small": 4096, "max": -(-(at * 3 // 2) // 99_990)}.get(case)
kind = "linear" if case == "linear" else "phases"
schedule = Schedule(points, kind=kind, window_tokens=window, total_tokens=at * 3 // 2)

def answer():
    layout = resolve_schedule(schedule, sources, tokens)
    table = layout.table()
    layout.window_targets(table.phase_windows[-1][0])
    layout.window_targets(layout.windows - 1)
    layout.expected_documents([10**7] * k)
    return layout.windows

out = {}
try:
    started = time.perf_counter()
    out["windows"] = answer()
    out["resolve_s"] = time.perf_counter() - started
    tracemalloc.start()
    answer()
    out["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
except (ConfigError, MemoryError) as err:
    out["resolve_s"] = time.perf_counter() - started
    out["error"] = f"{type(err).__name__}: {str(err)[:160]}"
    tracemalloc.stop()
print(json.dumps(out))
"""
#: bench_scale's shards (its default ``--rows-per-shard``)
ROWS_PER_SHARD = 1000


def window_part(args: argparse.Namespace) -> None:
    """``--part window`` (see the module docstring)."""
    rng = np.random.default_rng(0)
    n, k = args.sequences, args.sources
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, size=n * k), 1, 4096).astype(np.int32)
    tokens = [int(lengths[s * n : (s + 1) * n].sum(dtype=np.int64)) for s in range(k)]
    names = [f"s{s}" for s in range(k)]
    weights = [rng.uniform(0.5, 2.0, size=k) for _ in range(args.phases)]
    last = dict(zip(names, weights[-1].tolist()))
    flat = tuple(Source(f"/{x}", weight=last[x], name=x) for x in names)
    table = solve_mixture(flat, [n] * k, tokens)
    window = table.tokens_per_epoch
    phase_tokens = 8 * window
    points = [
        {"at_tokens": p * phase_tokens, "weights": dict(zip(names, w.tolist()))}
        for p, w in enumerate(weights)
    ]
    schedule = Schedule(points, window_tokens=window, total_tokens=args.phases * phase_tokens)
    capped = tuple(Source(f"/{x}", weight=1.0, max_repetitions=1e6, name=x) for x in names)
    index = MixtureIndex.of([n] * k)
    digests = tuple(f"digest-{x}" for x in names)
    unscheduled = Mixture(flat, table, index, digests)
    best = {"resolve_s": float("inf"), "window_s": float("inf"), "epoch_s": float("inf")}
    layout = None
    chosen = {}
    for _ in range(REPEATS):
        started = time.perf_counter()
        layout = resolve_schedule(schedule, capped, tokens)
        best["resolve_s"] = min(best["resolve_s"], time.perf_counter() - started)
        scheduled = Mixture(capped, table, index, digests, schedule=layout)
        for name, mixture, epoch in (
            ("window_s", scheduled, layout.windows - 1),
            ("epoch_s", unscheduled, 7),
        ):
            started = time.perf_counter()
            chosen[name] = len(mixture.documents(mixture.units(lengths), 0, epoch))
            best[name] = min(best[name], time.perf_counter() - started)
    assert layout is not None
    figures = {
        **{key: round(value, 4) for key, value in best.items()},
        "ratio": round(best["window_s"] / best["epoch_s"], 3),
        "windows": layout.windows,
        "window_tokens": window,
        "window_documents": chosen["window_s"],
        "epoch_documents": chosen["epoch_s"],
        "sequences": n * k,
    }
    print(json.dumps(figures))
    record_result("bench_schedule", figures, vars(args))


# --------------------------------------------------------------------------------------------
# --part first-batch
# --------------------------------------------------------------------------------------------

SIDES = ("scheduled", "unscheduled", "one")


@dataclass(frozen=True)
class Sources:
    """bench_scale's synthetic index cut by shards into sources (one mixture id space)."""

    lengths: np.ndarray
    shard_starts: np.ndarray
    shard_tokens: np.ndarray
    shard_buckets: np.ndarray
    source_shards: np.ndarray
    index: MixtureIndex
    documents: list[int]
    tokens: list[int]


def open_sources(folder: str, k: int) -> Sources:
    """The index of ``folder`` as ``k`` sources of whole shards, about equal in sequences."""
    lengths, shards = load_index(folder)
    starts = shards["starts"]
    n = int(starts[-1])
    first = np.searchsorted(starts, [n * s // k for s in range(k)], side="left")
    offsets = np.r_[starts[first], n].astype(np.int64)
    tokens = np.add.reduceat(shards["tokens"], first)
    return Sources(lengths, starts, shards["tokens"], shards["buckets"].astype(np.int32),
                   np.r_[first, len(starts) - 1].astype(np.int64), MixtureIndex(offsets),
                   np.diff(offsets).tolist(), [int(t) for t in tokens])  # fmt: skip


def source_units(src: Sources, mixture: Mixture) -> list:
    """Every source's units by shard, as ``MixtureSelection.source_units`` gives them."""
    starts, tokens = [], []
    for s in range(len(src.documents)):
        a, b = int(src.source_shards[s]), int(src.source_shards[s + 1])
        starts.append(src.shard_starts[a : b + 1] - src.shard_starts[a])
        tokens.append(src.shard_tokens[a:b])
    return mixture.units(src.lengths, None, starts, tokens)


def epoch_index(src: Sources, mixture: Mixture | None, epoch: int) -> Any:
    """The stream planner's index of an epoch: a mixture's ``EpochShards``, or one cache's."""
    if mixture is None:
        return ShardIndex(src.shard_starts, src.shard_tokens, src.shard_buckets, src.lengths)

    def buckets(source: int, shard: int, local: np.ndarray) -> np.ndarray:
        return np.full(len(local), src.shard_buckets[src.source_shards[source] + shard], np.int32)

    epochs = mixture.epochs(source_units(src, mixture), 0, epoch)
    return EpochShards(epochs, src.index.offsets, buckets)


def mixture_of(src: Sources, args: argparse.Namespace, side: str) -> tuple[Mixture, int]:
    """The mixture of one side and the epoch measured: the first window of the last phase."""
    k = len(src.documents)
    rng = np.random.default_rng(0)
    names = [f"s{s}" for s in range(k)]
    weights = [rng.uniform(0.5, 2.0, size=k) for _ in range(args.phases)]
    flat = tuple(Source(f"/{x}", weight=w, name=x) for x, w in zip(names, weights[-1].tolist()))
    table = solve_mixture(flat, src.documents, src.tokens)
    digests = tuple(f"digest-{x}" for x in names)
    if side in ("unscheduled", "one"):  # (one: one cache of the same documents)
        return Mixture(flat, table, src.index, digests), args.phases * args.phase_windows
    window = table.tokens_per_epoch
    phase_tokens = args.phase_windows * window
    points = [{"at_tokens": p * phase_tokens, "weights": dict(zip(names, w.tolist()))}
              for p, w in enumerate(weights)]  # fmt: skip
    schedule = Schedule(points, window_tokens=window, total_tokens=args.phases * phase_tokens)
    capped = tuple(Source(f"/{x}", weight=1.0, max_repetitions=1e6, name=x) for x in names)
    layout = resolve_schedule(schedule, capped, src.tokens)
    epoch = layout.table().phase_windows[-1][0]
    return Mixture(capped, table, src.index, digests, schedule=layout), epoch


def first_batch(
    folder: str, args: argparse.Namespace, side: str, variant: str, given: dict | None
) -> dict[str, Any]:
    """Rank 0's first batch of the measured epoch, from opening the sources (see docstring)."""
    world, options = args.world, PlanOptions(max_tokens=args.max_tokens)
    tracing = tracemalloc.is_tracing()
    if tracing:
        gc.collect()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    src = open_sources(folder, args.sources)
    mixture, epoch = mixture_of(src, args, side)

    def layout() -> StreamLayout:  # Planner.layout
        index = epoch_index(src, None if side == "one" else mixture, epoch)
        return StreamLayout(index, world, args.block, 0, epoch, True)

    streams = layout()
    if variant == "all":
        got = count_batches(streams, options)
    elif variant == "prepare":  # prepare(): own streams, the exchange; then plan(): again
        assert given is not None
        got = dict(given)
        got.update(count_batches(streams, options, own_streams(world, 0, world)))
        streams = layout()
    else:
        assert given is not None
        got = given
    plan = StreamPlan(streams, options, got)
    split = split_epoch(len(plan), world, 0, options.tail)
    ids = plan.batch(int(split.for_rank(0)[0]))
    seconds = time.perf_counter() - start
    assert len(ids) > 0
    out = {"first_batch_s": seconds, "epoch": epoch, "global_batches": len(plan),
           "batches_per_rank": split.batches_per_rank,
           "window_documents": int(streams.row_cum[-1]), "counts": got}  # fmt: skip
    if tracing:  # the peak, and what the rank holds while it reads the epoch
        now, peak = tracemalloc.get_traced_memory()
        out["traced_peak_mib"], out["held_mib"] = (peak - base) / 2**20, (now - base) / 2**20
    return out


def warm_up(args: argparse.Namespace) -> float:
    """Load numba's compiled kernels on a tiny mixture index (outside the timing)."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 20_000), 16, 4096).astype(np.int32)
    buckets = np.searchsorted(BUCKET_EDGES, lengths).astype(np.int32)
    starts = np.arange(0, 20_001, 1000, dtype=np.int64)
    tokens = np.add.reduceat(lengths.astype(np.int64), starts[:-1])
    index = ShardIndex(starts, tokens, buckets[starts[:-1]], lengths)
    plan = StreamPlan(StreamLayout(index, 4, 4096, 0, 0, True), PlanOptions(args.max_tokens))
    plan.batch(0)
    return time.perf_counter() - started


def first_batch_part(args: argparse.Namespace) -> None:
    """``--part first-batch`` (see the module docstring)."""
    sizes, variants = counts(args.sizes), [v for v in args.variants.split(",") if v]
    timed_max, all_timed_max = count(args.timed_max), count(args.all_timed_max)
    folders = {n: make_index(args.work, n, ROWS_PER_SHARD) for n in sizes}
    warmup_s = warm_up(args)
    runs: dict[str, list[dict[str, Any]]] = {}
    given: dict[tuple[str, int], dict] = {}
    tracemalloc.start()  # round 0: memory (and every stream's counts for the others)
    for n in sizes:
        for variant in ["all"] + [v for v in variants if v != "all"]:
            for side in SIDES:
                got = first_batch(folders[n], args, side, variant, given.get((side, n)))
                given.setdefault((side, n), got.pop("counts"))
                if variant in variants:
                    runs.setdefault(f"{side}-{variant}-{human(n)}", []).append(got)
                print(f"  traced {side} {variant} {human(n)}: {got['first_batch_s']:.2f} s, "
                      f"{got['traced_peak_mib']:.0f} MiB, held {got['held_mib']:.0f} MiB",
                      flush=True)  # fmt: skip
    tracemalloc.stop()
    for _ in range(args.repeats):
        for n in sizes:
            if n > timed_max:
                continue
            for variant in variants:
                if variant == "all" and n > all_timed_max:
                    continue
                for side in SIDES:  # both sides interleaved in each round
                    gc.collect()
                    got = first_batch(folders[n], args, side, variant, given[(side, n)])
                    got.pop("counts")
                    runs[f"{side}-{variant}-{human(n)}"].append(got)
                    print(f"  {side} {variant} {human(n)}: {got['first_batch_s']:.2f} s",
                          flush=True)  # fmt: skip
    figures: dict[str, Any] = {}
    for key, got in runs.items():
        timed = got[1:] or got
        top = dict(min(timed, key=lambda r: r["first_batch_s"]))
        top["traced_peak_mib"] = got[0]["traced_peak_mib"]
        top["held_mib"] = got[0]["held_mib"]
        top["timed_rounds"] = len(got) - 1  # 0: the time is of the traced round
        figures[key] = top
    largest = max(sizes)
    for n in counts(args.extrapolate):
        for side in SIDES:
            for variant in variants:
                ref = figures[f"{side}-{variant}-{human(largest)}"]
                figures[f"{side}-{variant}-{human(n)}"] = {
                    "extrapolated": True,
                    "first_batch_s": ref["first_batch_s"] * n / largest,
                    "traced_peak_mib": ref["traced_peak_mib"] * n / largest,
                    "held_mib": ref["held_mib"] * n / largest,
                }
    every = sorted({*sizes, *counts(args.extrapolate)})
    print(f"\nfirst batch of rank 0, W = C = {args.world}, {args.sources} sources, epoch: the "
          f"first window of phase {args.phases} (scheduled) / an epoch of the last phase's "
          f"weights (unscheduled); pad, max_tokens {args.max_tokens}, shuffle_block "
          f"{args.block}; times best of {args.repeats}")  # fmt: skip
    print("\n| N | variant | side | first batch s | traced peak MiB | held MiB "
          "| window documents "
          "| batches/rank | side / one cache s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for n in every:
        for variant in variants:
            for side in SIDES:
                top = figures.get(f"{side}-{variant}-{human(n)}")
                if top is None:
                    continue
                mark = " (extrapolated)" if top.get("extrapolated") else ""
                if top.get("timed_rounds") == 0:
                    mark = " (traced)"
                other = figures[f"one-{variant}-{human(n)}"]
                ratio = top["first_batch_s"] / other["first_batch_s"]
                print(f"| {human(n)} | {variant} | {side}{mark} | {top['first_batch_s']:.2f} | "
                      f"{top['traced_peak_mib']:.0f} | {top['held_mib']:.0f} | "
                      f"{top.get('window_documents', '-')} | "
                      f"{top.get('batches_per_rank', '-')} | "
                      f"{ratio:.2f} |")  # fmt: skip
    growth = {}
    for variant in variants:
        for side in SIDES:
            for a, b in itertools.pairwise(every):
                lo = figures[f"{side}-{variant}-{human(a)}"]
                hi = figures[f"{side}-{variant}-{human(b)}"]
                growth[f"{side}-{variant}-{human(a)}-{human(b)}"] = {
                    "size_x": b / a,
                    "time_x": hi["first_batch_s"] / lo["first_batch_s"],
                    "memory_x": hi["traced_peak_mib"] / lo["traced_peak_mib"],
                    "held_x": hi["held_mib"] / lo["held_mib"],
                }
    print("\n| side | variant | N | N x | time x | traced peak x | held x |")
    print("|---|---|---|---|---|---|---|")
    for key, g in growth.items():
        side, variant, a, b = key.split("-")
        print(f"| {side} | {variant} | {a} -> {b} | {g['size_x']:.1f} | {g['time_x']:.2f} | "
              f"{g['memory_x']:.2f} | {g['held_x']:.2f} |")  # fmt: skip
    figures = {"first_batch": figures, "growth": growth, "warmup_s": warmup_s}
    record_result("bench_schedule_first_batch", figures, vars(args))


def _point(tree: str, at: int, case: str, sources: int) -> dict[str, Any]:
    """One ``--part point`` measurement in a fresh process with ``tree`` first on sys.path."""
    args = [sys.executable, "-c", POINT_CHILD, tree, str(at), case, str(sources)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:  # (a MemoryError past the interpreter's reach: the last line)
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def point_part(args: argparse.Namespace) -> None:
    """``--part point`` (see the module docstring)."""
    if args.base is None:
        raise SystemExit("--part point needs --base TREE (the checkout before the change)")
    this = args.this or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"base": os.path.abspath(args.base), "this": os.path.abspath(this)}
    ats = [int(eval(x, {})) if "**" in x else int(float(x)) for x in args.at.split(",")]
    cases = [c for c in args.cases.split(",") if c]
    best: dict[str, dict[str, dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for at in ats:
            for case in cases:
                for side, tree in trees.items():  # both sides interleaved in each round
                    got = _point(tree, at, case, args.sources)
                    kept = best.setdefault(f"{case}-{at}", {}).setdefault(side, got)
                    if got.get("resolve_s", math.inf) < kept.get("resolve_s", math.inf):
                        kept["resolve_s"] = got["resolve_s"]
    print("\n| at_tokens | case | side | windows or error | resolve s | traced peak MiB |")
    print("|---|---|---|---|---|---|")
    for key, sides in best.items():
        case, at = key.split("-")
        for side in trees:
            got = sides[side]
            what = f"{got['windows']:,}" if "windows" in got else got.get("error", "?")[:70]
            resolve = f"{got['resolve_s']:.4f}" if "resolve_s" in got else "-"
            peak = f"{got['traced_peak_mib']:.2f}" if "traced_peak_mib" in got else "-"
            print(f"| {int(at):.3g} | {case} | {side} | {what} | {resolve} | {peak} |")
    record_result("bench_schedule_point", {"cases": best, "trees": trees}, vars(args))


def main() -> None:
    """Run the chosen part."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="window", choices=("window", "first-batch", "point"))
    parser.add_argument("--sources", type=int, default=20)
    parser.add_argument("--sequences", type=int, default=1_000_000, help="window: per source")
    parser.add_argument("--phases", type=int, default=3)
    parser.add_argument("--sizes", default="20M,60M,200M", help="first-batch: total sequences")
    parser.add_argument("--extrapolate", default="", help="first-batch: sizes extrapolated")
    parser.add_argument("--world", type=int, default=1024, help="first-batch: W = streams")
    parser.add_argument("--phase-windows", type=int, default=8, help="first-batch")
    parser.add_argument("--variants", default="given,prepare,all", help="first-batch")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="first-batch: best of")
    parser.add_argument("--timed-max", default="200M", help="first-batch: timed rounds up to")
    parser.add_argument("--all-timed-max", default="20M", help="first-batch: 'all' timed up to")
    parser.add_argument("--max-tokens", type=int, default=16 * 4096, help="first-batch: pad")
    parser.add_argument("--block", type=int, default=1 << 18, help="first-batch: shuffle_block")
    parser.add_argument(
        "--work",
        default=os.path.join(tempfile.gettempdir(), "shardcache-bench-scale"),
        help="first-batch: where bench_scale's synthetic indexes are kept (200M: 0.8 GB)",
    )
    parser.add_argument("--base", help="point: the other checkout (before the change)")
    parser.add_argument("--this", help="point: the checkout after it (default: this one)")
    parser.add_argument("--at", default="1e9,1e12,1e14,1e16,1e18,2**62", help="point")
    parser.add_argument("--cases", default="default,small,max,linear,capped", help="point")
    args = parser.parse_args()
    if args.part == "window":
        window_part(args)
    elif args.part == "point":
        point_part(args)
    else:
        first_batch_part(args)


if __name__ == "__main__":
    main()
