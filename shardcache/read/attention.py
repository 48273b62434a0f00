"""Per-document attention for packed rows: the keys a transformers model needs, from positions.

Pure numpy; no Python loop over tokens. Everything here is derived from ``position_ids``
alone, as collate.py lays them out: a packed row is a run of segments whose positions restart
at 0, the padding run at a row's end being one more segment.
Token ``i`` of a row therefore belongs to the segment that starts at ``i - position_ids[i]``.

Why this module exists (measured with tiny random Qwen2 / Llama models, transformers 5.24,
``model.train()``): ``position_ids`` alone do *not* isolate the documents of a row.
transformers derives per-document masks from them only when no cache object exists, and with
the default ``use_cache=True`` one is created even in training, so every document attended to
the documents packed before it (logits ~0.8 off). Three modes, chosen with
``ShardDataset(mode="pack", attention=...)``:

``"mask"`` (:func:`block_causal_mask`): ``attention_mask`` is a 4-D *additive float* mask
``R x 1 x L x L``: 0 where query ``i`` may see key ``j`` (same segment, ``j <= i``), the most
negative float32 elsewhere. transformers passes a 4-D mask through as it is, so this is exact
with ``sdpa``, ``eager`` and any implementation that honours 4-D masks, whatever ``use_cache``.
It must be additive: ``eager`` adds the mask to the scores, so a boolean mask (right for sdpa)
is 0.85 off there. Padding attends causally to itself only, so no query row is fully masked
(no NaN, also when the mask is cast to bf16 and its minimum becomes ``-inf``). Memory:
``R * L * L * 4`` bytes per batch, 128 MiB for ``max_tokens=8192, seq_len=4096`` (R = 2),
against 64 KiB for the token ids (int64); it takes ~40-70 ms to build on one core
(benchmarks/bench_attention.py): it is built in the loader process, travels to the device
with the batch and costs host->device bandwidth (and pinned memory: ``DevicePrefetcher``'s
default ``PrefetchOptions.max_pinned_bytes`` of 1 GiB over 3 slots refuses a batch above
~341 MiB, e.g. ``seq_len=8192`` with two rows). Use ``"varlen"`` with flash attention for long
rows.

``"varlen"`` (:func:`varlen_keys`): ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, the segment
boundaries in the flattened ``R * L`` tokens, ending at ``R * L``) and ``max_length_q`` /
``max_length_k`` (Python ints), equal to what transformers'
``prepare_fa_kwargs_from_position_ids`` computes for the batch. ``flash_attention_2/3`` read
them (they need ``attention_mask`` absent, which it is). ``sdpa`` and ``eager`` ignore them and
are exact only when the caller passes ``use_cache=False`` (transformers then detects the packed
documents from ``position_ids``).

``"none"``: position ids only; documents attend to each other (packed pretraining that
accepts it). Exact only with ``use_cache=False`` on sdpa / eager, as above.
"""

from __future__ import annotations

import numpy as np

from shardcache.errors import ConfigError

#: The values of ``ShardDataset(attention=...)`` in pack mode.
ATTENTION_MODES = ("mask", "varlen", "none")


def segment_starts(position_ids: np.ndarray) -> np.ndarray:
    """Per token, the index (within its row) where its segment starts: ``i - position_ids[i]``.

    ``position_ids`` is ``R x L`` with positions restarting at 0 at every segment.
    """
    positions = np.asarray(position_ids)
    if positions.ndim != 2:
        raise ConfigError(
            f"position_ids: got shape {positions.shape}, expected a 2-D R x L array (the "
            "position_ids of a packed batch, restarting at 0 at every segment)"
        )
    return np.arange(positions.shape[1], dtype=np.int64)[None, :] - positions


def block_causal_mask(position_ids: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """The additive 4-D mask ``R x 1 x L x L`` of packed rows: 0 where query ``i`` may attend
    to key ``j`` (``start(i) <= j <= i``: same segment, causal), ``finfo(dtype).min`` elsewhere.

    ``R * L * L * itemsize`` bytes (see the module docstring). The mask is filled once and
    each segment's lower triangle is cleared in place: a loop over segments (tens per batch),
    never over tokens. That touches the ``L * L`` fill plus the diagonal blocks; one broadcast
    comparison over ``R x L x L`` took twice as long (benchmarks/bench_attention.py).
    """
    positions = np.asarray(position_ids)
    if positions.ndim != 2:
        raise ConfigError(
            f"position_ids: got shape {positions.shape}, expected a 2-D R x L array (the "
            "position_ids of a packed batch, restarting at 0 at every segment)"
        )
    rows, length = positions.shape
    out: np.ndarray = np.empty((rows, 1, length, length), dtype=dtype)
    out.fill(np.finfo(dtype).min)
    lower = np.tri(length, dtype=bool)
    row_of, start_of = np.nonzero(positions == 0)  # segment starts, row-major
    ends = np.append(start_of[1:], length)
    ends[np.append(row_of[1:] != row_of[:-1], True)] = length  # a row's last segment
    for r, s, e in zip(row_of.tolist(), start_of.tolist(), ends.tolist()):
        np.copyto(out[r, 0, s:e, s:e], 0, where=lower[: e - s, : e - s])
    return out


def varlen_keys(position_ids: np.ndarray) -> dict[str, np.ndarray | int]:
    """``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (int) of the flattened batch, as
    transformers' ``prepare_fa_kwargs_from_position_ids`` computes them: a sequence starts
    wherever the position equals the minimum position (0), and ``R * L`` closes the last one."""
    flat = np.asarray(position_ids).reshape(-1)
    starts = np.flatnonzero(flat == flat.min())
    cu = np.empty(len(starts) + 1, dtype=np.int32)
    cu[:-1] = starts
    cu[-1] = flat.size
    longest = int(np.diff(cu).max())
    # two arrays, not one shared: a consumer that moves or edits one must not touch the other
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.copy(),
        "max_length_q": longest,
        "max_length_k": longest,
    }
