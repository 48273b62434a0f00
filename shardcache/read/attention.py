"""Per-document attention for packed rows: the keys a transformers model needs, from positions.

Pure numpy, derived from ``position_ids`` alone: token ``i`` of a row belongs to the segment
that starts at ``i - position_ids[i]`` (padding is one more segment). ``position_ids`` alone
do not isolate documents in transformers when a cache object exists (``use_cache=True``, also
in training), hence ``ShardDataset(mode="pack", attention=...)``:

* ``"mask"`` (:func:`block_causal_mask`): a 4-D additive float32 mask ``R x 1 x L x L`` (0
  where query ``i`` sees key ``j``: same segment, ``j <= i``; the most negative float32
  elsewhere), exact with sdpa and eager whatever ``use_cache``; ``R * L * L * 4`` bytes.
  Padding attends causally to itself, so no row is fully masked (no NaN).
* ``"varlen"`` (:func:`varlen_keys`): ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` as
  transformers' ``prepare_fa_kwargs_from_position_ids`` computes them, for flash attention;
  sdpa and eager are exact only with ``use_cache=False``.
* ``"none"``: nothing added (documents attend to each other).
"""

from __future__ import annotations

import numpy as np

from shardcache.errors import ConfigError

#: The values of ``ShardDataset(attention=...)`` in pack mode.
ATTENTION_MODES = ("mask", "varlen", "none")


def segment_starts(position_ids: np.ndarray) -> np.ndarray:
    """Per token, where (within its row) its segment starts: ``i - position_ids[i]``.

    Args:
        position_ids: ``R x L`` positions restarting at 0 at every segment.

    Returns:
        int64, ``R x L``.

    Raises:
        ConfigError: ``position_ids`` is not 2-D.
    """
    positions = np.asarray(position_ids)
    if positions.ndim != 2:
        raise ConfigError(
            f"position_ids: got shape {positions.shape}, expected a 2-D R x L array (the "
            "position_ids of a packed batch, restarting at 0 at every segment)"
        )
    return np.arange(positions.shape[1], dtype=np.int64)[None, :] - positions


def block_causal_mask(position_ids: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """The additive 4-D mask ``R x 1 x L x L`` of packed rows.

    0 where query ``i`` may attend to key ``j`` (same segment, ``j <= i``), ``finfo(dtype).min``
    elsewhere; filled once, then each segment's lower triangle cleared in place (a loop over
    segments, never over tokens).

    Args:
        position_ids: ``R x L`` positions restarting at 0 at every segment.
        dtype: the float type.

    Returns:
        The mask, ``R * L * L * itemsize`` bytes.

    Raises:
        ConfigError: ``position_ids`` is not 2-D.
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
    """The flash-attention keys of a packed batch, as transformers computes them from positions.

    Args:
        position_ids: ``R x L`` positions restarting at 0 at every segment.

    Returns:
        ``cu_seq_lens_q/k`` (int32, the segment boundaries of the flattened batch, ending at
        ``R * L``) and ``max_length_q/k`` (int).
    """
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
