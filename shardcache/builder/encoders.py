"""Encoders: how a build turns records into ids, chosen in one place.

``TextEncoder`` (text) and ``ChatEncoder`` (conversations) make up ``Encoder``;
``encoder_spec`` and ``encoder_in_worker`` carry one to workers as JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any, Union

from shardcache.builder.backends import EncoderSelection
from shardcache.builder.chat import ChatEncoder
from shardcache.builder.early_load import adopt_agreed, load_fast_early
from shardcache.builder.preference import PreferenceEncoder
from shardcache.builder.tokenize import TextEncoder
from shardcache.builder.tokenizer_memo import read_resolved, tokenizer_json_text
from shardcache.config import BuildOptions, ChatOptions, TokenizeOptions

Encoder = Union[TextEncoder, ChatEncoder]  # noqa: UP007 - a runtime alias
EncoderFactory = Callable[[BuildOptions], Encoder]


def make_encoder(
    tokenize: TokenizeOptions,
    chat: ChatOptions | None,
    preload_fast: bool = False,
    *,
    audit: bool = False,
) -> Encoder:
    """A ``TextEncoder``, or for chat data a ``ChatEncoder`` wrapping one.

    Text comes from the tokenizer memo when it agrees with the folder, else from transformers;
    ``audit`` never reads the memo. ``preload_fast`` starts loading the fast backend from
    tokenizer.json first, overlapping the tokenizer's resolution; that load is used only when the
    memo agreed with that very text or its content equals what transformers resolved.
    """
    if chat is not None:
        return chat_encoder(TextEncoder(tokenize), chat)
    folder = tokenize.tokenizer
    saved = tokenizer_json_text(folder) if preload_fast or not audit else None
    early = load_fast_early(folder, saved) if preload_fast and saved is not None else None
    resolved = None if audit else read_resolved(folder, saved)
    if resolved is None:
        return TextEncoder(tokenize, preload_fast=preload_fast, early=early)
    encoder = TextEncoder.from_resolved(tokenize, resolved, preload_fast and early is None)
    if early is not None:  # the memo agreed with the text it loads
        encoder.fast_loading = adopt_agreed(early)
    return encoder


def chat_encoder(text: TextEncoder, chat: ChatOptions) -> ChatEncoder:
    """A ``ChatEncoder``, or for preference pairs a ``PreferenceEncoder``, wrapping ``text``."""
    return (PreferenceEncoder if chat.preference else ChatEncoder)(text, chat)


def encodes_fast(encoder: Encoder) -> bool:
    """Whether the encoder is text on a fast backend whose encode calls release the GIL.

    Partitions may then share one process in threads; HF, chat and Python-written backends need
    processes to use every core.
    """
    return (
        isinstance(encoder, TextEncoder) and encoder.fast is not None and encoder.fast.releases_gil
    )


def encoder_spec(encoder: Encoder) -> dict[str, Any]:
    """Plain JSON a worker rebuilds the encoder from (text without importing transformers)."""
    if isinstance(encoder, ChatEncoder):
        return {
            "kind": "chat",
            "tokenize": dataclasses.asdict(encoder.text.options),
            "chat": dataclasses.asdict(encoder.options),
            "selection": encoder.text.selection.to_json(),  # the gate's decision (always HF)
        }
    return {"kind": "text", "text": encoder.spec()}


_WORKER_ENCODERS: dict[str, Encoder] = {}


def encoder_in_worker(spec: dict[str, Any]) -> Encoder:
    """The encoder of ``spec`` in a worker, built once per process, on the gate's backend."""
    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _WORKER_ENCODERS:
        if spec["kind"] == "text":
            _WORKER_ENCODERS[key] = TextEncoder.from_spec(spec["text"])
        else:
            text = TextEncoder(TokenizeOptions(**spec["tokenize"]))
            text.use_fast(None, EncoderSelection(**spec["selection"]), text.verify_fraction)
            _WORKER_ENCODERS[key] = chat_encoder(text, ChatOptions(**spec["chat"]))
    return _WORKER_ENCODERS[key]


def reference_only(encoder: Encoder) -> Encoder:
    """``encoder`` on the HF reference alone: itself if it already is, else a copy."""
    text = encoder.text if isinstance(encoder, ChatEncoder) else encoder
    if text.fast is None:
        return encoder
    if not isinstance(encoder, ChatEncoder):
        return text.reference_only()
    chat = copy.copy(encoder)
    chat.text = text.reference_only()
    return chat


def take_lint(encoder: Encoder) -> dict[str, int]:
    """The chat lint counts gathered since the last call, then reset (empty for text)."""
    if not isinstance(encoder, ChatEncoder):
        return {}
    return encoder.take_lint()


def encoder_for(options: BuildOptions, factory: EncoderFactory | None = None) -> Encoder:
    """The encoder of a build, made by ``factory`` when given (tests)."""
    if factory is not None:
        return factory(options)
    preload = options.encoding.encoder != "hf" and options.chat is None
    return make_encoder(options.tokenize, options.chat, preload)
