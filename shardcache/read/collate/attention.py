"""Per-document attention keys of packed rows, derived from ``position_ids`` alone (numpy).

transformers does not isolate documents by ``position_ids`` once a cache object exists
(``use_cache=True``, also in training): ``"mask"`` (4-D, ``R * L * L * 4`` bytes) is exact with
sdpa and eager whatever ``use_cache``; ``"varlen"`` (flash attention) is exact with sdpa and
eager only with ``use_cache=False``; ``"none"`` adds nothing (documents see each other).
"""

from __future__ import annotations

import numpy as np

from shardcache.config import check_choice
from shardcache.errors import ConfigError

#: The values of ``ShardDataset(attention=...)`` in pack mode.
ATTENTION_MODES = ("mask", "varlen", "none")


def segment_starts(position_ids: np.ndarray) -> np.ndarray:
    """Per token of ``R x L`` positions, where its segment starts in its row (int64)."""
    positions = np.asarray(position_ids)
    if positions.ndim != 2:
        raise ConfigError(
            f"position_ids: got shape {positions.shape}, expected a 2-D R x L array (the "
            "position_ids of a packed batch, restarting at 0 at every segment)"
        )
    return np.arange(positions.shape[1], dtype=np.int64)[None, :] - positions


def block_causal_mask(position_ids: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """The additive ``R x 1 x L x L`` mask of packed rows: 0 where query ``i`` sees key ``j``.

    Padding is a segment of its own and attends causally to itself, so no row is fully masked.
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
    """Flash attention's ``cu_seq_lens_q/k`` and ``max_length_q/k``, as transformers makes them."""
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


def check_attention(attention: str | None, mode: str) -> str | None:
    """Check ``attention``: required in pack mode (no silent default), refused in pad mode."""
    if mode == "pack":
        if attention is None:
            raise ConfigError(
                "attention: mode='pack' needs attention= one of "
                f"{', '.join(ATTENTION_MODES)}: 'mask' (4-D block-causal attention_mask; exact "
                "with sdpa/eager), 'varlen' (cu_seq_lens_* for flash attention; sdpa/eager "
                "need use_cache=False), 'none' (documents attend to each other). Without it, "
                "transformers lets every document attend to the ones packed before it"
            )
        check_choice("attention", attention, ATTENTION_MODES)
    elif attention is not None:
        raise ConfigError(
            f"attention: got {attention!r} with mode={mode!r}; it applies to mode='pack' only "
            "(padded rows carry a 2-D attention_mask that every model honours). Drop attention="
        )
    return attention
