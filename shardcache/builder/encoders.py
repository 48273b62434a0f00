"""Encoders: how a build turns records into ids, chosen in one place.

Two encoders share one protocol (:data:`Encoder`): :class:`~shardcache.builder.tokenize.TextEncoder`
for plain text and :class:`~shardcache.builder.chat.ChatEncoder` (which wraps a text encoder) for
conversations. Both expose ``encode_texts`` (raw batch encode), ``finish`` (EOS, truncation,
masks -> :class:`~shardcache.builder.tokenize.Encoded`), ``describe``, ``template_component`` and
``dtype``. :func:`encoder_for` picks the encoder of a build; :func:`encoder_spec` /
:func:`encoder_from_spec` carry it to worker processes as plain JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any, Union

from shardcache.builder.backends import EncoderSelection, load_fast_early
from shardcache.builder.chat import ChatEncoder
from shardcache.builder.tokenize import TextEncoder
from shardcache.builder.tokenizer_memo import read_resolved
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
    """A TextEncoder for plain text, or a ChatEncoder wrapping one for chat data
    (``preload_fast``: start loading the fast backend for the gate, text only; ``audit``:
    never read the memo, for ``check``, ``lock`` and ``verify --tokens``).

    Plain text whose tokenizer folder was resolved before is built from the memo
    (:func:`~shardcache.builder.tokenizer_memo.read_resolved`, used only when it agrees with
    the folder's files) without importing transformers; else through transformers, which
    writes the memo. On a miss the fast
    backend starts loading from the folder's tokenizer.json before transformers is imported
    (:func:`~shardcache.builder.backends.load_fast_early`). Chat always loads transformers
    (rendering needs it)."""
    if chat is not None:
        return ChatEncoder(TextEncoder(tokenize), chat)
    resolved = None if audit else read_resolved(tokenize.tokenizer)
    if resolved is not None:
        return TextEncoder.from_resolved(tokenize, resolved, preload_fast)
    early = load_fast_early(tokenize.tokenizer) if preload_fast else None
    return TextEncoder(tokenize, preload_fast=preload_fast, early=early)


def encoder_spec(encoder: Encoder) -> dict[str, Any]:
    """Plain-JSON description from which :func:`encoder_from_spec` rebuilds the encoder in a
    worker process: text carries what transformers resolved (no transformers import in the
    worker); chat loads the tokenizer again as the build did (rendering needs transformers)."""
    if isinstance(encoder, ChatEncoder):
        return {
            "kind": "chat",
            "tokenize": dataclasses.asdict(encoder.text.options),
            "chat": dataclasses.asdict(encoder.options),
            "selection": encoder.text.selection.to_json(),  # the gate's decision (always HF)
        }
    return {"kind": "text", "text": encoder.spec()}


def encoder_from_spec(spec: dict[str, Any]) -> Encoder:
    """The encoder :func:`encoder_spec` describes, with the build's backend selection."""
    if spec["kind"] == "chat":
        chat = ChatEncoder(TextEncoder(TokenizeOptions(**spec["tokenize"])),
                           ChatOptions(**spec["chat"]))  # fmt: skip
        chat.text.use_fast(None, EncoderSelection(**spec["selection"]), chat.text.verify_fraction)
        return chat
    return TextEncoder.from_spec(spec["text"])


_WORKER_ENCODERS: dict[str, Encoder] = {}


def encoder_in_worker(spec: dict[str, Any]) -> Encoder:
    """The encoder of ``spec`` in a worker process (pool or Ray), built once per process.

    Args:
        spec: what :func:`encoder_spec` gave in the build process.

    Returns:
        The encoder, with the backend the build's gate chose.
    """
    key = json.dumps(spec, sort_keys=True, default=str)
    encoder = _WORKER_ENCODERS.get(key)
    if encoder is None:
        encoder = _WORKER_ENCODERS[key] = encoder_from_spec(spec)
    return encoder


def reference_only(encoder: Encoder) -> Encoder:
    """``encoder`` encoding with the HF reference alone: the fallback of a partition whose
    fast ids differed from HF's. A new encoder; ``encoder`` itself is left as it is.

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
    """The lint counts gathered since the last call (per partition), then reset."""
    if not isinstance(encoder, ChatEncoder):
        return {}
    return encoder.take_lint()


def encoder_for(options: BuildOptions, factory: EncoderFactory | None = None) -> Encoder:
    """The encoder of a build: ``factory(options)`` when given (tests), else the default."""
    if factory is not None:
        return factory(options)
    preload = options.encoding.encoder != "hf" and options.chat is None
    return make_encoder(options.tokenize, options.chat, preload)
