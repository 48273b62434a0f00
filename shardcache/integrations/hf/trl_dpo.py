"""TRL's ``DPOTrainer`` on the pairs of a preference cache, without tokenizing them again.

``DPOTrainer`` trains on rows of ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (its
``DataCollatorForPreference`` joins prompt + completion, pads, and takes the loss on the
completion); ``trl_pairs`` makes that ``datasets.Dataset`` from a cache. ``DPOTrainer.__init__``
maps every train dataset through its tokenization, which fails on rows without strings;
``CachedPairsDPOTrainer`` passes a dataset that already holds the id columns through. That is an
override of a private TRL method (``_prepare_dataset``), checked against the installed TRL when
this module is imported. TRL (1.x) computes its log-probs through its fused output layer, which
never holds a batch's whole logits, so nothing is chunked here.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pyarrow as pa

from shardcache.errors import ConfigError, MissingDependencyError
from shardcache.integrations.requirements import INSTALL, require
from shardcache.store.cache import Cache, open_cache

_trl = require("trl", "shardcache.integrations.hf.CachedPairsDPOTrainer")
require("datasets", "shardcache.integrations.hf.trl_pairs")

from datasets import Dataset  # noqa: E402  (after the checks that name the extra)
from trl import DPOTrainer  # noqa: E402

#: The columns of TRL's pre-tokenized preference rows.
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def check_dpo_trainer(trainer_class: type) -> None:
    """Raise MissingDependencyError unless ``trainer_class`` has the method the adapter overrides.

    Args:
        trainer_class: TRL's ``DPOTrainer`` (or a class standing for it).

    Raises:
        MissingDependencyError: ``trainer_class._prepare_dataset`` is missing or does not take
            ``(dataset, processing_class, args, dataset_name)``: the installed TRL is not one
            the adapter was written for.
    """
    method = getattr(trainer_class, "_prepare_dataset", None)
    takes = callable(method)
    if takes:
        try:
            inspect.signature(method).bind(None, None, None, None, "train")
        except (TypeError, ValueError):
            takes = False
    if not takes:
        version = getattr(_trl, "__version__", "unknown")
        raise MissingDependencyError(
            f"trl {version}: {trainer_class.__name__} has no _prepare_dataset(dataset, "
            "processing_class, args, dataset_name), the private method CachedPairsDPOTrainer "
            "overrides to pass pre-tokenized pairs through; install a TRL it was tested with "
            f"(trl>=1.16,<2, in the train extra: {INSTALL})"
        )


check_dpo_trainer(DPOTrainer)


class CachedPairsDPOTrainer(DPOTrainer):
    """TRL's ``DPOTrainer`` that takes a dataset already holding token ids as it is.

    A train or eval dataset with ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` columns
    (``trl_pairs``) skips TRL's prompt extraction, EOS and tokenization; any other dataset goes
    through them as in ``DPOTrainer``. Everything else is ``DPOTrainer``'s: its collator, loss
    and batches (``per_device_train_batch_size`` pairs, padded). Pass the tokenizer the cache
    was built with as ``processing_class`` (its pad id pads the rows). It takes
    ``DPOTrainer``'s arguments (``model``, ``ref_model``, ``args``,
    ``train_dataset=trl_pairs(cache)``, ``processing_class``, ...).

    Raises:
        MissingDependencyError: at import, the installed TRL lacks the overridden method
            (``check_dpo_trainer``).
    """

    def _prepare_dataset(
        self, dataset: Any, processing_class: Any, args: Any, dataset_name: str
    ) -> Any:
        if set(PAIR_COLUMNS) <= set(getattr(dataset, "column_names", None) or ()):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)


def trl_pairs(cache: str | Cache) -> Dataset:
    """A preference cache's pairs as TRL's rows of ``prompt_ids``, ``chosen_ids``, ``rejected_ids``.

    Row ``k`` is pair ``k`` (sample ids ``2k``, ``2k + 1``); the prompt is each side's tokens
    before its first trainable one. TRL trains on the whole completion, so a pair converts only
    when each side's trainable tokens are one run to its end and both sides share the prompt:
    string pairs always do; a chat pair whose template leaves untrained tokens after the answer
    does not (train on the cache's masks with ``ShardDataset`` and
    ``causal_lm_pair_logps`` instead).

    Args:
        cache: a preference cache (path, URL or ``Cache``).

    Returns:
        A ``datasets.Dataset`` of ``len(cache) // 2`` rows of int64 id lists.

    Raises:
        ConfigError: the cache is not a preference cache, or a pair does not split into a
            shared prompt and completions trained whole (the first such pair is named, with
            the count of such pairs).
    """
    opened = cache if isinstance(cache, Cache) else open_cache(cache)
    name = opened.path
    if not opened.is_preference:
        raise ConfigError(
            f"trl_pairs: {name} is not a preference cache; build it with --preference "
            "(records with prompt, chosen and rejected)"
        )
    got = opened.gather(np.arange(opened.num_sequences), with_mask=True)
    lengths = got.lengths
    row = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(got.tokens)) - got.offsets[row]
    first = np.minimum.reduceat(np.where(got.mask, pos, lengths[row]), got.offsets[:-1])
    ragged = np.add.reduceat(got.mask.astype(np.int64), got.offsets[:-1]) != lengths - first
    prompt = first[0::2]
    same = prompt == first[1::2]
    same[same] = [  # equal prompt lengths: compare the tokens
        np.array_equal(got.tokens[a : a + n], got.tokens[b : b + n])
        for a, b, n in zip(got.offsets[0:-1:2][same], got.offsets[1::2][same], prompt[same])
    ]
    bad = np.flatnonzero(ragged[0::2] | ragged[1::2] | ~same)
    if len(bad):
        k = int(bad[0])
        raise ConfigError(
            f"trl_pairs: {name}: pair {k} (sample ids {2 * k}, {2 * k + 1}) does not split into "
            "a shared prompt and completions trained whole, the rows TRL's DPOTrainer reads "
            f"({len(bad)} of {len(prompt)} pairs are like it); train on the cache's masks with "
            "ShardDataset and shardcache.integrations.hf.causal_lm_pair_logps "
            "(recipes/train_dpo.py)"
        )
    in_prompt = pos < first[row]
    chosen_row = row % 2 == 0

    def lists(select: np.ndarray, counts: np.ndarray) -> pa.ListArray:
        offsets = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        return pa.ListArray.from_arrays(offsets, got.tokens[select].astype(np.int64))

    table = pa.table({
        "prompt_ids": lists(in_prompt & chosen_row, prompt),
        "chosen_ids": lists(~in_prompt & chosen_row, lengths[0::2] - prompt),
        "rejected_ids": lists(~in_prompt & ~chosen_row, lengths[1::2] - prompt),
    })  # fmt: skip
    return Dataset(table)
