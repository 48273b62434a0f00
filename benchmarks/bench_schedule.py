#!/usr/bin/env python3
"""Schedule benchmark: what a schedule adds to choosing a mixture epoch's documents.

    python benchmarks/bench_schedule.py [--sources 20] [--sequences 1000000] [--phases 3]

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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from results import record_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardcache.read.mixture import Mixture, MixtureIndex, Source, solve_mixture
from shardcache.read.schedule import Schedule, resolve_schedule

REPEATS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=20)
    parser.add_argument("--sequences", type=int, default=1_000_000)
    parser.add_argument("--phases", type=int, default=3)
    args = parser.parse_args()
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
            chosen[name] = len(mixture.documents(lengths, 0, epoch))
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


if __name__ == "__main__":
    main()
