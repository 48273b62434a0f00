"""The read layer: cache -> training batches.

It owns everything a training job needs once a cache exists: the epoch plan and its split over
ranks and DataLoader workers (``plan``, pure numpy over the length index), the turning of planned
sequences into batch arrays (``collate``, pure numpy: padding, packing, labels, positions,
``cu_seqlens``), the per-document attention keys of packed rows (``attention``, pure numpy: the
4-D mask, the varlen keys), the resumable ``ShardDataset`` (``dataset``, torch), the
``DevicePrefetcher`` that moves batches to the accelerator (``prefetch``, torch) and the
one-call ``loader`` that wires them together (``loader``, torch). It reads caches through the store
(the on-disk contract) and the top-level ``config``, ``errors`` and ``version`` modules, and never
imports the build side: a reader process imports neither transformers nor tokenizers.
"""
