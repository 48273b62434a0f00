#!/usr/bin/env python3
"""What a built-in read-time transform costs per batch (not part of the tests).

    python benchmarks/bench_transforms.py CACHE [--max-tokens 16384] [--batches 200]
                                                [--mode pad|concat] [--rounds 3]

One process, no DataLoader, the same cache and plan for every configuration:

* ``none``: no transform (the compiled batch path where the cache allows it);
* ``identity``: a transform that returns its input (the numpy path plus the per-sequence
  call and generator: the floor of any transform);
* ``span_mask``: ``SpanMask(0.15, MASK_ID)``;
* ``fim_keep``: ``FIM(0.5, ..., spm_rate=0.5, keep_length=True)`` (the length-keeping form);
* ``fim``: ``FIM(0.5, ..., spm_rate=0.5)``, the sentinels added (``max_growth`` 3, reserved by
  the plan: a few more batches, each timed the same way; in concat mode on whole documents).

Each configuration reads ``--batches`` batches after one warm-up batch; the configurations are
interleaved (none, identity, span_mask, fim_keep, fim, none, ...) and the best of ``--rounds``
is kept.
Reports seconds per batch and the ratio to ``none``. The token ids used as sentinels and mask
are the cache's first ids (the cost does not depend on which ids they are).
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

from shardcache import FIM, ShardDataset, SpanMask


def identity(ids: np.ndarray, mask: np.ndarray | None, rng: np.random.Generator):
    """Return the sequence unchanged: what the transform machinery costs by itself."""
    return ids, mask


def _time_batches(ds: ShardDataset, batches: int) -> tuple[float, int, int]:
    """Seconds for ``batches`` batches after one warm-up batch, their count and real tokens."""
    it = iter(ds)
    next(it)
    began = time.perf_counter()
    count = tokens = 0
    for batch in it:
        tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else 0
        count += 1
        if count == batches:
            break
    return time.perf_counter() - began, count, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--mode", choices=["pad", "concat"], default="pad")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    transforms = {
        "none": None,
        "identity": identity,
        "span_mask": SpanMask(0.15, 3),
        "fim_keep": FIM(0.5, 0, 1, 2, spm_rate=0.5, keep_length=True),
        "fim": FIM(0.5, 0, 1, 2, spm_rate=0.5),
    }
    extra = (
        {}
        if args.mode == "pad"
        else {"mode": "pack", "packing": "concat", "seq_len": 2048, "attention": "none"}
    )
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    compiled = None
    for _ in range(args.rounds):
        for name, transform in transforms.items():
            ds = ShardDataset(args.cache, args.max_tokens, seed=0, transform=transform, **extra)
            seconds, count, _tokens = _time_batches(ds, args.batches)
            if name == "none":
                compiled = ds.reads_compiled
            per_batch = seconds / max(count, 1)
            best[name] = min(best.get(name, float("inf")), per_batch)
            counts[name] = count
    figures = {
        "mode": args.mode,
        "none_compiled": compiled,
        "batches": counts["none"],
        **{f"{name}_ms_per_batch": round(best[name] * 1e3, 3) for name in transforms},
        **{f"{name}_ratio": round(best[name] / best["none"], 3) for name in transforms},
    }
    print(json.dumps(figures))
    print("| transform | ms / batch | x none |\n|---|---|---|")
    for name in transforms:
        print(f"| {name} | {best[name] * 1e3:.2f} | {best[name] / best['none']:.2f} |")
    record_result("bench_transforms", figures, args)


if __name__ == "__main__":
    main()
