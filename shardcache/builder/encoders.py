"""Encoders: how a build turns records into ids, chosen in one place.

:class:`~shardcache.builder.tokenize.TextEncoder` (text) and
:class:`~shardcache.builder.chat.ChatEncoder` (conversations) share the :data:`Encoder`
protocol; :func:`encoder_spec` / :func:`encoder_in_worker` carry one to workers as JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any, Union

from shardcache.builder.backends import EncoderSelection, adopt_agreed, load_fast_early
from shardcache.builder.chat import ChatEncoder
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
    """A TextEncoder, or for chat data a ChatEncoder wrapping one.

    Text is built from the tokenizer memo when it agrees with the folder, else through
    transformers; ``audit`` never reads the memo. ``preload_fast`` starts loading the fast
    backend for the gate from tokenizer.json first thing, so the load overlaps resolving the
    tokenizer; it is used when the memo agrees with that very text, or when its content
    equals what transformers resolved.

    Args:
        tokenize: the tokenizer options.
        chat: the chat options (None: text).
        preload_fast: start loading the fast backend for the gate.
        audit: never read the memo.

    Returns:
        The encoder.
    """
    if chat is not None:
        return ChatEncoder(TextEncoder(tokenize), chat)
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


def encodes_fast(encoder: Encoder) -> bool:
    """Whether a build's encoder is a text encoder on a fast backend whose encode calls
    release the GIL (partitions may then share one process, in threads).

    Args:
        encoder: the build's encoder, after the gate.

    Returns:
        True for a text encoder with such a backend; False for HF and chat encoders and for a
        backend that encodes in Python (its partitions need processes to use every core).
    """
    return (
        isinstance(encoder, TextEncoder) and encoder.fast is not None and encoder.fast.releases_gil
    )


def encoder_spec(encoder: Encoder) -> dict[str, Any]:
    """What a worker rebuilds an encoder from (text without importing transformers).

    Args:
        encoder: the encoder.

    Returns:
        A plain-JSON description.
    """
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
    """The encoder of ``spec`` in a worker process (pool or Ray), built once per process.

    Args:
        spec: what :func:`encoder_spec` gave in the build process.

    Returns:
        The encoder, with the backend the build's gate chose.
    """
    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _WORKER_ENCODERS:
        if spec["kind"] == "text":
            _WORKER_ENCODERS[key] = TextEncoder.from_spec(spec["text"])
        else:
            text = TextEncoder(TokenizeOptions(**spec["tokenize"]))
            text.use_fast(None, EncoderSelection(**spec["selection"]), text.verify_fraction)
            _WORKER_ENCODERS[key] = ChatEncoder(text, ChatOptions(**spec["chat"]))
    return _WORKER_ENCODERS[key]


def reference_only(encoder: Encoder) -> Encoder:
    """``encoder`` encoding with the HF reference alone (``encoder`` is left as it is).

    Args:
        encoder: a build's encoder.

    Returns:
        ``encoder`` itself when it already uses HF, else a copy that does.
    """
    text = encoder.text if isinstance(encoder, ChatEncoder) else encoder
    if text.fast is None:
        return encoder
    if not isinstance(encoder, ChatEncoder):
        return text.reference_only()
    chat = copy.copy(encoder)
    chat.text = text.reference_only()
    return chat


def take_lint(encoder: Encoder) -> dict[str, int]:
    """The lint counts gathered since the last call (per partition), then reset.

    Args:
        encoder: the encoder.

    Returns:
        The counts by name (empty for text).
    """
    if not isinstance(encoder, ChatEncoder):
        return {}
    return encoder.take_lint()


def encoder_for(options: BuildOptions, factory: EncoderFactory | None = None) -> Encoder:
    """The encoder of a build.

    Args:
        options: the build's options.
        factory: makes it instead (tests); None: the default.

    Returns:
        The encoder.
    """
    if factory is not None:
        return factory(options)
    preload = options.encoding.encoder != "hf" and options.chat is None
    return make_encoder(options.tokenize, options.chat, preload)
