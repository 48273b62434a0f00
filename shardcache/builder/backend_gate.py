"""The start-up gate of a build: which encoder backend it uses, decided once, with a reason.

``gate_encoder`` compares the fast backend with HF on the key's probe and a corpus sample drawn
over the plan; any difference, refusal or chat data means HF for the whole build. The reason
goes to the manifest, the report and ``info``; workers get the decision in the encoder's spec.
"""

from __future__ import annotations

from typing import Any

from shardcache.builder.ahead import Ahead
from shardcache.builder.backends import (
    GATE_SAMPLE_CHARS,
    GATE_SAMPLE_DOCS,
    EncoderSelection,
    FastBackend,
    load_fast_ahead,
    select_backend,
)
from shardcache.builder.build_plan import BuildPlan
from shardcache.builder.chunking import HUGE_CHARS
from shardcache.builder.key_computation import probe_texts
from shardcache.builder.sampled_verify import verify_rate
from shardcache.builder.sources import InputSlice, iter_text_batches
from shardcache.config import BuildOptions
from shardcache.errors import SourceError

#: Partitions the corpus sample is drawn from (evenly spaced over the plan).
GATE_PARTITIONS = 8

#: Raw bytes the sample decodes at a time: a partition gives only its first few documents.
SAMPLE_CHUNK_BYTES = 64 * 1024


def corpus_sample(
    plan: BuildPlan, limit: int = GATE_SAMPLE_DOCS, max_chars: int = GATE_SAMPLE_CHARS
) -> list[str]:
    """The gate's texts: the first documents of partitions over the plan, huge ones skipped."""
    partitions = plan.partitions
    if not partitions or limit <= 0:
        return []
    step = max(1, len(partitions) // GATE_PARTITIONS)
    chosen = partitions[::step][:GATE_PARTITIONS]
    per_partition = max(1, limit // len(chosen))
    options = plan.options
    texts: list[str] = []
    chars_per_partition = max_chars // len(chosen)
    for partition in chosen:
        chars, taken = 0, 0  # of this partition (a group: its first files' documents)
        for k, file in enumerate(partition.files[:per_partition]):
            batches = iter_text_batches(
                file,
                text_field=options.source.text_field,
                batch_docs=per_partition - taken,
                on_error="skip",
                part=partition.span if k == 0 else InputSlice(),
                on_corrupt=lambda *args: None,
                chunk_bytes=SAMPLE_CHUNK_BYTES,
            )
            try:
                for batch in batches:
                    for text in batch.texts[: limit - len(texts)]:
                        if len(text) > HUGE_CHARS:
                            continue  # HF encodes huge documents in the build, never the fast one
                        if chars and chars + len(text) > chars_per_partition:
                            break
                        texts.append(text)
                        chars += len(text)
                        taken += 1
                    break
            except SourceError:
                pass  # the build itself reports the unreadable input
            finally:
                batches.close()
            if taken >= per_partition or len(texts) >= limit:
                break
        if len(texts) >= limit:
            break
    return texts


def start_loading(encoder: Any, options: BuildOptions) -> Ahead[FastBackend] | None:
    """The fast backend's background load (the encoder's, else new); None if it may not be used."""
    if options.encoding.encoder == "hf" or options.chat is not None:
        return None
    text = getattr(encoder, "text", encoder)
    return getattr(text, "fast_loading", None) or load_fast_ahead(text.serialized)


def gate_encoder(
    encoder: Any, plan: BuildPlan, loading: Ahead[FastBackend] | None = None
) -> EncoderSelection:
    """Run the gate; ``encoder`` then uses its choice (``EncoderError``: fast cannot be used)."""
    options = plan.options
    text = getattr(encoder, "text", encoder)
    requested = options.encoding.encoder
    chat = options.chat is not None
    sample = [] if chat or requested == "hf" else corpus_sample(plan)
    fast, selection = select_backend(
        requested,
        text.serialized,
        text.reference,
        text.add_special_tokens,
        [] if chat else probe_texts(encoder),
        chat=chat,
        sample=sample,
        loading=loading,
    )
    input_bytes = sum(f.size for f in plan.inputs)
    text.use_fast(fast, selection, verify_rate(options.encoding.verify_fraction, input_bytes))
    text.fast_loading = None  # a refused backend is not kept alive
    return selection
