"""Preference pairs: ``{"prompt", "chosen", "rejected"}`` records -> two masked sequences each.

A pair is stored as two adjacent rows of one shard, chosen (piece 0) then rejected (piece 1),
so pair ``k`` of a cache is sample ids ``2k`` and ``2k + 1`` (docs/guide/preference.md). Each
side holds the prompt and its completion; only the completion carries a loss. Strings: the
prompt and the completion are tokenized apart and joined (BOS as the tokenizer adds it, EOS
appended to the completion under ``append_eos``), as TRL tokenizes them. Message lists: the
prompt plus the completion rendered with the chat template, the completion's assistant turns
trainable (``ChatRenderer`` spans), ending as the template ends the turn: no EOS is appended (as
for chat data, and as TRL's DPOTrainer does). Over ``max_length`` / ``max_prompt_length`` a pair is
dropped whole, or with ``truncation = "truncate"`` both sides are cut alike: each prompt to its
last ``max_prompt_length`` tokens, each side then to ``max_length`` (the completion's budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.builder.chat import (
    ChatEncoder,
    ChatLint,
    ChatRenderer,
    ChatSample,
    bos_added_by_post_processor,
    encoding_mask,
    encoding_weights,
    message_weights,
)
from shardcache.builder.tokenize import Encoded
from shardcache.config import ChatOptions
from shardcache.errors import TokenizerError


def split_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, str | None]:
    """TRL's implicit-prompt shape: ``((prompt, chosen, rejected), None)``, else ``(None, reason)``.

    Conversations (lists of valid messages): the prompt is the longest common prefix of whole
    messages (equal as dicts: role, content and any other key), and both sides must go on with
    an assistant turn and end with one; ``no_shared_prompt`` when they share nothing,
    ``divergence_not_assistant`` / ``last_not_assistant`` otherwise, ``empty_completion`` when
    a side is the prefix of the other. Strings: TRL's ``extract_prompt``: the longest common
    *character* prefix, a space just before the first difference going to the completions (the
    prefix may end inside a word: ``"... is f"`` + ``"our"`` / ``"ive"``).
    """
    n = min(len(chosen), len(rejected))
    if isinstance(chosen, str):
        if not chosen or not rejected:
            return None, "empty_completion"
        a = np.frombuffer(chosen[:n].encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        b = np.frombuffer(rejected[:n].encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        differ = np.flatnonzero(a != b)
        cut = int(differ[0]) if len(differ) else n
        if cut == n:  # one text is the other's prefix: a side has no completion
            return None, "empty_completion"
        if cut and chosen[cut - 1] == " ":
            cut -= 1  # as TRL: the space before the completions starts them
    else:
        cut = next((i for i in range(n) if chosen[i] != rejected[i]), n)
        if cut == n:
            return None, "empty_completion"
        if cut and (chosen[cut]["role"] != "assistant" or rejected[cut]["role"] != "assistant"):
            return None, "divergence_not_assistant"
        if cut and (chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant"):
            return None, "last_not_assistant"
    if cut == 0:
        return None, "no_shared_prompt"
    return (chosen[:cut], chosen[cut:], rejected[cut:]), None


@dataclass
class PairSample:
    """A pair's two sides (ids and trainable mask each), or the ``error`` it failed with."""

    sides: list[tuple[np.ndarray, np.ndarray]] | None = None
    error: str | None = None
    straddle: int = 0
    chat: bool = False  # message lists: the template ends the turn, no EOS appended


class PreferenceEncoder(ChatEncoder):
    """The preference counterpart of ``ChatEncoder``: ``encode_texts`` / ``finish`` per pair.

    The chat template is needed only for message-list records: without one, such a record is
    a bad record (``no_chat_template``).
    """

    def __init__(self, text: Any, options: ChatOptions):
        try:
            super().__init__(text, options)
        except TokenizerError as err:  # string pairs need no template
            self._no_template = str(err)
            self.renderer = ChatRenderer.without_template()
            self.text, self.options, self.hf = text, options, text.hf
            self.dtype, self.eos_id, self.backend = text.dtype, text.eos_id, text.backend
            self.bos_id = bos_added_by_post_processor(text)
            self.unk_id = getattr(text.hf, "unk_token_id", None)
            self.special_set = frozenset() if text.eos_id is None else frozenset({text.eos_id})
            self.lint, self._checked = ChatLint(), 0
        else:
            self._no_template = None

    def template_component(self) -> dict[str, Any]:
        """The template part of the cache key: kind ``preference``, the chat template, EOS.

        ``loss_weights`` (the weight policy) only with message weights, as for chat.
        """
        component = {
            "kind": "preference",
            "source": self.renderer.template,
            "options": {"add_generation_prompt": False, "variables": self.renderer.variables},
            "train_on": "completion",
            "strings": "prompt and completion tokenized apart, BOS as the tokenizer adds it",
            "implicit_prompt": "messages: the longest common prefix of whole messages, before "
            "an assistant turn; strings: the longest common character prefix, a space before "
            "the first difference going to the completions",
            "append_eos": {"strings": self.text.options.append_eos, "messages": False},
        }
        if self.options.keep_identical_pairs:  # (the default, quarantined, adds nothing)
            component["identical_sides"] = "kept"
        return self._with_weights(component)

    def probe_chat(self) -> str:
        """The chat probe; ``<no chat template>`` when the tokenizer has none."""
        if self._no_template is not None:
            return "<no chat template>"
        return super().probe_chat()

    def encode_texts(
        self, pairs: list[tuple[Any, Any, Any]], keys: np.ndarray | None = None
    ) -> list[PairSample]:
        """Tokenize a batch of ``(prompt, chosen, rejected)`` (``keys`` unused, as for chat)."""
        out: list[PairSample | None] = [None] * len(pairs)
        strings = [i for i, p in enumerate(pairs) if isinstance(p[0], str)]
        chats = [i for i, p in enumerate(pairs) if not isinstance(p[0], str)]
        if strings:
            for i, sample in zip(strings, self._encode_strings([pairs[i] for i in strings])):
                out[i] = sample
        if chats:
            for i, sample in zip(chats, self._encode_chats([pairs[i] for i in chats])):
                out[i] = sample
        return [s if s is not None else PairSample(error="template_error") for s in out]

    def _with_bos(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """BOS prepended when the post-processor adds it; ``mask``: bool, or float32 weights."""
        if self.bos_id is not None and (len(ids) == 0 or ids[0] != self.bos_id):
            return np.concatenate([[self.bos_id], ids]), np.r_[np.zeros(1, mask.dtype), mask]
        return ids, mask

    def _encode_strings(self, pairs: list[tuple[str, str, str]]) -> list[PairSample]:
        texts = [t for p in pairs for t in p]  # prompt, chosen, rejected per pair
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        samples = []
        for k in range(len(pairs)):
            prompt = np.asarray(encodings[3 * k].ids, dtype=np.int64)
            sides = []
            for side in (1, 2):
                completion = np.asarray(encodings[3 * k + side].ids, dtype=np.int64)
                ids = np.concatenate([prompt, completion])
                mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(completion), bool)]
                sides.append(self._with_bos(ids, mask))
            samples.append(PairSample(sides=sides))
        return samples

    def _encode_chats(self, pairs: list[tuple[list, list, list]]) -> list[PairSample]:
        if self._no_template is not None:
            return [PairSample(error=f"no_chat_template: {self._no_template}")] * len(pairs)
        conversations = [p[0] + p[side] for p in pairs for side in (1, 2)]
        firsts = [len(p[0]) for p in pairs for _ in (1, 2)]
        rendered = self.renderer.render(conversations, firsts)
        good = [r for r in rendered if r.error is None]
        encodings = iter(self.backend.encode_batch([r.text for r in good],
                                                   add_special_tokens=False))  # fmt: skip
        field_name = self.options.weight_field
        sides: list[Any] = []
        for r, conversation in zip(rendered, conversations):
            if r.error is not None:
                sides.append(r.error)
                continue
            enc = next(encodings)
            ids = np.asarray(enc.ids, dtype=np.int64)
            if field_name is None:
                mask, straddle = encoding_mask(enc, len(ids), r.spans)
            else:  # float32 loss weights stand in for the mask (0: untrainable)
                weights = message_weights(conversation, field_name)
                if isinstance(weights, str):
                    sides.append(weights)
                    continue
                span_w = [weights[i] for i in r.messages]
                mask, straddle = encoding_weights(enc, len(ids), r.spans, span_w)
            sides.append((*self._with_bos(ids, mask), straddle))
        checked = [ChatSample(ids=s[0]) if not isinstance(s, str) else ChatSample(error=s)
                   for s in sides]  # fmt: skip
        self._lint_against_transformers(conversations, checked)  # as for chat data
        samples = []
        for k in range(len(pairs)):
            chosen, rejected = sides[2 * k], sides[2 * k + 1]
            error = next((s for s in (chosen, rejected) if isinstance(s, str)), None)
            if error is not None:
                samples.append(PairSample(error=error))
                continue
            samples.append(PairSample(sides=[chosen[:2], rejected[:2]],
                                      straddle=chosen[2] + rejected[2], chat=True))  # fmt: skip
        return samples

    def finish(self, samples: list[PairSample], stats: Any) -> Encoded:
        """Two rows per kept pair (chosen, rejected), cut or dropped together over the limits.

        ``stats.documents`` counts pairs, ``sequences`` rows; the ``Encoded`` has ``failed``
        entries for pairs that could not be encoded.
        """
        append = self.text.options.append_eos and self.eos_id is not None
        keep_ids, keep_masks, doc_index, failed = [], [], [], []
        for i, sample in enumerate(samples):
            if sample.sides is None:
                reason = (sample.error or "template_error").split(":")[0]
                failed.append((i, reason, sample.error or reason))
                continue
            sides = []
            for ids, mask in sample.sides:
                if append and not sample.chat and (len(ids) == 0 or ids[-1] != self.eos_id):
                    ids, mask = np.append(ids, self.eos_id), np.append(mask, True)
                sides.append((ids, mask))
            if not self.options.keep_identical_pairs and _identical(*sides):
                detail = (
                    f"identical_sides: chosen and rejected are the same {len(sides[0][0])} "
                    "tokens, a pair with no preference; fix the record, or build with "
                    "--keep-identical-pairs (keep_identical_pairs = true) to keep such pairs"
                )
                failed.append((i, "identical_sides", detail))
                continue
            stats.documents += 1
            self.lint.boundary_tokens += sample.straddle
            total = sum(len(ids) for ids, _ in sides)
            sides = self._limit(sides)
            if sides is None:
                stats.dropped_documents += 1
                stats.lost_tokens += total
                continue
            if not all(mask.any() for _, mask in sides):
                stats.dropped_no_trainable += 1
                stats.lost_tokens += total
                continue
            kept = sum(len(ids) for ids, _ in sides)
            if kept < total:
                stats.truncated_documents += 1
                stats.lost_tokens += total - kept
            for ids, mask in sides:
                self._lint_sample(ids, mask)
                keep_ids.append(ids)
                keep_masks.append(mask)
            doc_index += [i, i]
        piece = np.tile(np.array([0, 1], dtype=np.int32), len(keep_ids) // 2)
        return self._encoded(keep_ids, keep_masks, doc_index, piece, stats, failed)

    def _limit(
        self, sides: list[tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Both sides within ``max_prompt_length`` / ``max_length``: as they are, cut, or None.

        A side's prompt is every token before its first trainable one. ``truncate`` keeps the
        prompt's last ``max_prompt_length`` tokens (TRL's ``keep_end``) and then the first
        ``max_length`` tokens of the side: its completion gets ``max_length`` minus the kept
        prompt. ``drop``: None (the pair is dropped whole) when a side is over either limit; a
        side without a trainable token is over ``max_length`` only (it has no prompt: as in a
        chat build, such a side within ``max_length`` is then ``dropped_no_trainable``).
        """
        limit = self.text.options.max_length
        prompt_limit = self.options.max_prompt_length
        prompts = [int(np.argmax(mask > 0)) if mask.any() else len(mask) for _, mask in sides]
        # a side without a trainable token has no prompt to limit: the caller drops the pair
        # as ``dropped_no_trainable`` (a chat build's count), not as over the prompt limit
        over_prompt = prompt_limit is not None and any(
            p > prompt_limit for p, (_, mask) in zip(prompts, sides) if mask.any()
        )
        if not over_prompt and (limit is None or max(len(ids) for ids, _ in sides) <= limit):
            return sides
        if self.text.options.truncation != "truncate":
            return None
        out = []
        for (ids, mask), prompt in zip(sides, prompts):
            cut = max(0, prompt - prompt_limit) if prompt_limit is not None else 0
            keep = slice(cut, None if limit is None else cut + limit)
            out.append((ids[keep], mask[keep]))
        return out


def _identical(
    chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray]
) -> bool:
    """Whether a pair's two sides are the same ids with the same mask (or loss weights)."""
    return np.array_equal(chosen[0], rejected[0]) and np.array_equal(chosen[1], rejected[1])


def pair_bucket_lengths(lengths: np.ndarray) -> np.ndarray:
    """Per row of chosen/rejected pairs, the pair's longer side: a pair shares one bucket."""
    longer = np.maximum(lengths[0::2], lengths[1::2])
    return np.repeat(longer, 2)
