"""Chat / SFT data: render conversations with a chat template, tokenize once, exact loss masks.

A conversation is rendered whole with the template (as transformers does); each trainable
assistant turn is the character span between the renderings of its prefix with and
without it, and a template whose prefix renderings are not prefixes of the full text is a
bad record (``template_not_incremental``), never guessed. The text is tokenized once; a
token is trainable when its first character lies in a trainable span (docs/guide/chat.md).
With ``ChatOptions.weight_field`` each message may carry a loss weight in [0, 1]: a trainable
token gets the weight of its message (a weight-0 message is not trained), untrainable ones 0.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardcache.builder.tokenize import Encoded
from shardcache.config import ChatOptions
from shardcache.errors import TokenizerError

CHAT_BAD_REASONS = (
    "no_messages_field",
    "messages_not_list",
    "bad_message",
    "empty_messages",
    "template_error",
    "template_not_incremental",
    "template_budget",  # rendering took longer than RENDER_SECONDS or wrote > RENDER_CHARS
    "bad_weight",  # a message's loss weight is not a finite number in [0, 1]
)

#: Render budget per conversation (all its prefix renders): a looping template must not hang
#: the build.
RENDER_SECONDS = 5.0
#: Output budget per render, in characters.
RENDER_CHARS = 64 * 1024 * 1024


class RenderBudgetExceeded(Exception):
    """A template exceeded the per-conversation render budget (time or output size)."""


class _Watchdog:
    """Stops a render past its deadline, in whatever thread it runs.

    Compiled template code never yields to us, so one daemon thread per process raises an
    asynchronous exception in a render past its deadline; a render clears its deadline and any
    pending exception when done.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadlines: dict[int, float] = {}
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            time.sleep(0.02)
            now = time.monotonic()
            with self.lock:
                for ident, deadline in list(self.deadlines.items()):
                    if now > deadline:
                        del self.deadlines[ident]
                        _async_raise(ident, RenderBudgetExceeded)

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        ident = threading.get_ident()
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="shardcache-render-watchdog",
                                               daemon=True)  # fmt: skip
                self.thread.start()
            self.deadlines[ident] = time.monotonic() + seconds
        try:
            yield
        finally:
            with self.lock:
                self.deadlines.pop(ident, None)
                _async_raise(ident, None)  # clear an exception set but not raised yet


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


_WATCHDOG = _Watchdog()


@dataclass
class ChatLint:
    """Counts of suspicious samples (the ``template_*`` ones against ``apply_chat_template``).

    ``missing_end_of_turn``: the last trainable token is not EOS or an end-of-turn token;
    ``boundary_tokens``: tokens straddling a trainable span's boundary.
    """

    double_bos: int = 0
    missing_end_of_turn: int = 0
    unknown_tokens: int = 0
    boundary_tokens: int = 0
    template_mismatch: int = 0
    template_checked: int = 0

    def to_json(self) -> dict[str, int]:
        """The counts by name."""
        return asdict(self)


def validate_messages(value: Any) -> str | None:
    """The bad-record reason of a messages field; None for a usable conversation.

    Usable: a non-empty list of dicts whose ``role`` and ``content`` are strings.
    """
    if value is None:
        return "no_messages_field"
    if not isinstance(value, list):
        return "messages_not_list"
    if not value:
        return "empty_messages"
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            return "bad_message"
    return None


def _render_batch(
    conversations: list[list[dict[str, Any]]], template: str, variables: dict[str, Any],
    add_generation_prompt: bool,
) -> list[str]:  # fmt: skip
    """Render with transformers' own function (sandboxed Jinja, its data conversions)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=conversations,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    return rendered


class _FastRender:
    """``_render_batch``'s rendering, each conversation's messages converted only once.

    Prefixes render straight through the compiled template; unused when transformers lacks
    the private helpers.
    """

    def __init__(self, template: str, variables: dict[str, Any]):
        from transformers.utils import chat_template_utils as ctu

        self.compiled = ctu._compile_jinja_template(template)
        self.plain = ctu._plain_template_data
        self.alias = ctu._alias_reasoning_fields
        self.variables = self.plain(variables)

    def prepare(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.alias(self.plain(messages))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The rendered text; streamed so that an output over ``RENDER_CHARS`` stops."""
        parts, size = [], 0
        for part in self.compiled.generate(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.variables,
        ):  # fmt: skip
            size += len(part)
            if size > RENDER_CHARS:
                raise RenderBudgetExceeded(f"the output passed {RENDER_CHARS:,} characters")
            parts.append(part)
        return "".join(parts)


@dataclass
class Rendered:
    """A rendered conversation with its trainable ``[start, end)`` spans, or an ``error``.

    ``messages``: the message each span renders (its index in the conversation).
    """

    text: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None
    messages: list[int] = field(default_factory=list)


class ChatRenderer:
    """Renders conversations and finds the trainable character spans.

    Raises ``TokenizerError`` when no template file is given and the tokenizer has no usable one.
    """

    def __init__(self, hf: Any, options: ChatOptions):
        self.hf = hf
        self.options = options
        if options.template_path is not None:
            with open(options.template_path, encoding="utf-8") as f:
                self.template = f.read()
            self.template_kind = "jinja"
        else:
            template = getattr(hf, "chat_template", None)
            if not template:
                raise TokenizerError(
                    f"tokenizer {getattr(hf, 'name_or_path', '?')!r} has no chat_template; pass "
                    "--chat-template FILE.jinja"
                )
            if isinstance(template, dict):  # several named templates: use "default"
                if "default" not in template:
                    raise TokenizerError(
                        f"tokenizer has named chat templates {sorted(template)} but no "
                        "'default'; pass --chat-template FILE.jinja"
                    )
                template = template["default"]
            self.template = str(template)
            self.template_kind = "tokenizer"
        self.variables = dict(getattr(hf, "special_tokens_map", {}) or {})
        try:
            self._fast: _FastRender | None = _FastRender(self.template, self.variables)
        except (ImportError, AttributeError):  # other transformers versions: the public path
            self._fast = None

    @classmethod
    def without_template(cls) -> ChatRenderer:
        """A renderer with no template (preference string pairs): never asked to render."""
        renderer = cls.__new__(cls)
        renderer.template, renderer.template_kind = "", "none"
        renderer.variables, renderer._fast = {}, None
        return renderer

    def render_texts(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        """The full texts of valid conversations, without spans or budgets."""
        return _render_batch(conversations, self.template, self.variables, False)

    def render(
        self, conversations: Sequence[list[dict[str, Any]]], firsts: Sequence[int] | None = None
    ) -> list[Rendered]:
        """Full texts and trainable spans of valid conversations, under the render budget.

        A template that raises or exceeds the budget gives that conversation an ``error``.
        ``firsts`` (preference pairs): per conversation, the first message that may be trained
        on (the prompt's messages before it never are).
        """
        out: list[Rendered] = []
        for k, messages in enumerate(conversations):
            try:
                with _WATCHDOG.limit(RENDER_SECONDS):
                    rendered = self._render_one(messages, 0 if firsts is None else firsts[k])
                if len(rendered.text) > RENDER_CHARS:  # the public path renders unstreamed
                    raise RenderBudgetExceeded(f"the output passed {RENDER_CHARS:,} characters")
                out.append(rendered)
            except RenderBudgetExceeded as err:
                detail = str(err) or f"rendering took more than {RENDER_SECONDS:g} s"
                out.append(Rendered(error=f"template_budget: {detail}"))
            except Exception as err:  # a template can raise anything (jinja, exceptions)
                out.append(Rendered(error=f"template_error: {type(err).__name__}: {err}"))
        return out

    def _render_one(self, messages: list[dict[str, Any]], first: int = 0) -> Rendered:
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
        train_on = self.options.train_on
        if train_on == "last-assistant":
            assistant = assistant[-1:]
        if train_on == "all":
            assistant = []
        # the full text, then per trainable turn the prompt before it and the turn's end
        if self._fast is not None:
            fast = self._fast
            chat = fast.prepare(messages)
            full = fast.render(chat, False)
            ends = [fast.render(chat[: i + 1], False) for i in assistant]
            starts = [fast.render(chat[:i], True) for i in assistant]
        else:
            batch = [messages] + [messages[: i + 1] for i in assistant]
            full, *ends = _render_batch(batch, self.template, self.variables, False)
            prompts = [messages[:i] for i in assistant]
            starts = _render_batch(prompts, self.template, self.variables, True) if prompts else []
        if train_on == "all":
            return Rendered(full, [(0, len(full))])
        spans, which = [], []
        for start_text, end_text, i in zip(starts, ends, assistant):
            if not (full.startswith(end_text) and end_text.startswith(start_text)):
                return Rendered(error="template_not_incremental")
            if len(end_text) > len(start_text):
                spans.append((len(start_text), len(end_text)))
                which.append(i)
        return Rendered(full, spans, messages=which)


def encoding_mask(
    encoding: Any, n_tokens: int, spans: list[tuple[int, int]]
) -> tuple[np.ndarray, int]:
    """``token_mask`` through a ``tokenizers.Encoding``'s char -> token map."""
    mask = np.zeros(n_tokens, dtype=bool)
    ranges, straddle = _span_tokens(encoding, spans)
    for first, last in ranges:
        mask[first : last + 1] = True
    return mask, straddle


def encoding_weights(
    encoding: Any, n_tokens: int, spans: list[tuple[int, int]], span_weights: Sequence[float]
) -> tuple[np.ndarray, int]:
    """``encoding_mask`` as float32 loss weights: span ``k``'s tokens get ``span_weights[k]``.

    Tokens outside every span weigh 0, so ``weights > 0`` is the mask of the spans whose weight
    is not 0.
    """
    weights = np.zeros(n_tokens, dtype=np.float32)
    ranges, straddle = _span_tokens(encoding, spans)
    for (first, last), weight in zip(ranges, span_weights):
        weights[first : last + 1] = weight
    return weights, straddle


def _span_tokens(encoding: Any, spans: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
    """Per span, its first and last trainable token (``first > last``: none), and straddlers."""
    ranges, straddle = [], 0
    for lo, hi in spans:
        first = next((t for c in range(lo, hi) if (t := encoding.char_to_token(c)) is not None),
                     None)  # fmt: skip
        if first is None:
            ranges.append((0, -1))  # no token (e.g. whitespace the pre-tokenizer drops)
            continue
        last = next(t for c in range(hi - 1, lo - 1, -1)
                    if (t := encoding.char_to_token(c)) is not None)  # fmt: skip
        start, _ = encoding.token_to_chars(first)
        if start < lo:  # a token straddling the span start is not trainable
            straddle += 1
            first += 1
        if encoding.token_to_chars(last)[1] > hi:
            straddle += 1
        ranges.append((first, last))
    return ranges, straddle


def message_weights(messages: list[dict[str, Any]], weight_field: str) -> list[float] | str:
    """Each message's loss weight (absent or None: 1), or a ``bad_weight`` reason.

    The reason names the first message whose weight is not a finite number in [0, 1] (a bool
    is not a number here).
    """
    weights = []
    for i, message in enumerate(messages):
        value = message.get(weight_field)
        if value is None:
            weights.append(1.0)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return (
                f"bad_weight: message {i} has {weight_field}={value!r} "
                f"({type(value).__name__}); give a number in [0, 1] or leave it out (1)"
            )
        if not 0.0 <= value <= 1.0:  # (False for NaN too)
            return (
                f"bad_weight: message {i} has {weight_field}={value!r}; a loss weight is a "
                "finite number in [0, 1] (0: not trained, 1: trained fully)"
            )
        weights.append(float(value))
    return weights


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Trainable flags per token from ``n x 2`` character offsets, and the straddling count."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    straddle = 0
    for lo, hi in spans:
        inside = (starts >= lo) & (starts < hi)
        mask |= inside
        straddle += int(((starts < lo) & (ends > lo)).sum() + ((starts < hi) & (ends > hi)).sum())
    return mask, straddle


@dataclass
class ChatSample:
    """One conversation's ids and trainable mask, or (both None) the ``error`` it failed with.

    ``weights``: float32 loss weights per token (``ChatOptions.weight_field``), else None.
    """

    ids: np.ndarray | None = None
    mask: np.ndarray | None = None
    error: str | None = None
    straddle: int = 0
    weights: np.ndarray | None = None


class ChatEncoder:
    """The chat counterpart of ``TextEncoder``, with the same ``encode_texts``/``finish``.

    Wraps ``text`` (its tokenizer, backend and options). Raises ``TokenizerError`` when the
    tokenizer has no usable chat template and none was given.
    """

    def __init__(self, text: Any, options: ChatOptions):
        self.text = text  # the TextEncoder: tokenizer, backend, ids, dtype, options
        self.options = options
        self.renderer = ChatRenderer(text.hf, options)
        self.hf = text.hf
        self.dtype = text.dtype
        self.eos_id = text.eos_id
        self.backend = text.backend
        self.bos_id = bos_added_by_post_processor(text)
        self.unk_id = getattr(text.hf, "unk_token_id", None)
        specials = set(getattr(text.hf, "all_special_ids", []) or [])
        specials |= {int(t["id"]) for t in text.backend_json.get("added_tokens") or []
                     if t.get("special")}  # fmt: skip
        if text.eos_id is not None:
            specials.add(int(text.eos_id))
        self.special_set = frozenset(int(i) for i in specials)
        self.lint = ChatLint()
        self._checked = 0

    def describe(self) -> dict[str, Any]:
        """The manifest's tokenizer facts, with ``chat_template``: where the template came from.

        With message weights, ``loss_weights`` names their field: the cache's shards then store
        a ``weights`` column (``Cache.has_weights``).
        """
        described = {**self.text.describe(), "chat_template": self.renderer.template_kind}
        if self.options.weight_field is not None:
            described["loss_weights"] = self.options.weight_field
        return described

    def template_component(self) -> dict[str, Any]:
        """The template part of the cache key: source, options, ``train_on``, BOS/EOS policy.

        ``loss_weights`` (the weight policy) only with message weights: other keys are unchanged.
        """
        component = {
            "kind": "chat",
            "source": self.renderer.template,
            "options": {"add_generation_prompt": False, "variables": self.renderer.variables},
            "train_on": self.options.train_on,
            "bos_policy": "template, plus one BOS if the tokenizer adds BOS and none is written",
            "append_eos": self.text.options.append_eos,
        }
        return self._with_weights(component)

    def _with_weights(self, component: dict[str, Any]) -> dict[str, Any]:
        """A template component with the loss-weight policy, when message weights are read."""
        if self.options.weight_field is None:
            return component
        policy = {
            "field": self.options.weight_field,
            "policy": "a trainable token weighs its message's weight (absent: 1, 0: not "
            "trained); other tokens 0; float32",
        }
        return {**component, "loss_weights": policy}

    def probe_chat(self) -> str:
        """A demo conversation's rendering for the key's behaviour probe.

        A render failure is probed as ``<render failed: ...>``; exceeding the render budget
        raises ``TokenizerError``.
        """
        demo = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
        rendered = self.renderer.render([demo])[0]
        if rendered.error is not None:  # a template without system support
            rendered = self.renderer.render([demo[1:]])[0]
        if rendered.error is not None and rendered.error.startswith("template_budget"):
            raise TokenizerError(
                f"chat template ({self.renderer.template_kind}): rendering a 2-message demo "
                f"conversation exceeded the render budget ({rendered.error}); the template "
                "loops or recurses without bound: fix it or pass another --chat-template"
            )
        return rendered.text if rendered.error is None else f"<render failed: {rendered.error}>"

    def encode_texts(
        self, conversations: list[list[dict[str, Any]]], keys: np.ndarray | None = None
    ) -> list[ChatSample]:
        """Render and tokenize a batch (runs in the encode thread; encode_batch drops the GIL).

        ``keys`` is unused: HF alone encodes chat data, so nothing is verified.
        """
        field_name = self.options.weight_field
        weights_of: list[list[float] | str | None] = [None] * len(conversations)
        if field_name is not None:
            weights_of = [message_weights(m, field_name) for m in conversations]
        # a conversation with a bad weight is not rendered: it is a bad record
        todo = [k for k, w in enumerate(weights_of) if not isinstance(w, str)]
        rendered_todo = self.renderer.render([conversations[k] for k in todo])
        rendered: list[Rendered] = [Rendered(error=w) if isinstance(w, str) else Rendered()
                                    for w in weights_of]  # fmt: skip
        for k, r in zip(todo, rendered_todo):
            rendered[k] = r
        good = [r for r in rendered if r.error is None]
        encodings = self.backend.encode_batch([r.text for r in good], add_special_tokens=False)
        it = iter(encodings)
        samples = []
        for r, message_w in zip(rendered, weights_of):
            if r.error is not None:
                samples.append(ChatSample(error=r.error))
                continue
            enc = next(it)
            ids = np.asarray(enc.ids, dtype=np.int64)
            weights = None
            if isinstance(message_w, list):
                span_w = [message_w[i] for i in r.messages]
                weights, straddle = encoding_weights(enc, len(ids), r.spans, span_w)
                mask = weights > 0
            else:
                mask, straddle = encoding_mask(enc, len(ids), r.spans)
            if self.bos_id is not None and (len(ids) == 0 or ids[0] != self.bos_id):
                ids = np.concatenate([[self.bos_id], ids])
                mask = np.concatenate([[False], mask])
                if weights is not None:
                    weights = np.concatenate([np.zeros(1, np.float32), weights])
            samples.append(ChatSample(ids=ids, mask=mask, straddle=straddle, weights=weights))
        self._lint_against_transformers(conversations, samples)
        return samples

    def _lint_against_transformers(
        self, conversations: list[list[dict[str, Any]]], samples: list[ChatSample]
    ) -> None:
        for messages, sample in zip(conversations, samples):
            if self._checked >= self.options.lint_sample or sample.ids is None:
                continue
            self._checked += 1
            self.lint.template_checked += 1
            saved = getattr(self.hf, "model_max_length", None)
            try:  # a long sample is not an error here: no "longer than the maximum" warning
                self.hf.model_max_length = 1 << 62
                reference = self.hf.apply_chat_template(
                    messages, chat_template=self.renderer.template, tokenize=True,
                    return_dict=False,
                )  # fmt: skip
            finally:
                self.hf.model_max_length = saved
            if hasattr(reference, "get"):
                reference = reference.get("input_ids", reference)
            if list(map(int, reference)) != sample.ids.tolist():
                self.lint.template_mismatch += 1

    def take_lint(self) -> dict[str, int]:
        """The lint counts gathered since the last call (one partition's), then reset."""
        counts = self.lint.to_json()
        self.lint = ChatLint()
        self._checked = 0
        return counts

    def finish(self, samples: list[ChatSample], stats: Any) -> Any:
        """Truncate, drop samples with no trainable token, and lint, counting into ``stats``.

        The ``Encoded`` has a ``mask`` (float32 loss weights instead with message weights, 0
        where untrainable: the ``weights`` column travels as the mask, ``in_mask`` in its
        spec), and ``failed`` entries for conversations not rendered.
        """
        limit = self.text.options.max_length
        strategy = self.text.options.truncation
        from_left = self.options.truncation_side == "left"
        keep_ids, keep_masks, doc_index, failed = [], [], [], []
        for i, sample in enumerate(samples):
            if sample.ids is None or sample.mask is None:  # a bad record, not a document
                reason = (sample.error or "template_error").split(":")[0]
                failed.append((i, reason, sample.error or reason))
                continue
            stats.documents += 1
            ids, mask = sample.ids, sample.mask
            self.lint.boundary_tokens += sample.straddle
            self._lint_sample(ids, mask)
            # with message weights the weights are the mask (0: untrainable): cut alike
            if sample.weights is not None:
                mask = sample.weights
            if (
                self.text.options.append_eos
                and self.eos_id is not None
                and (len(ids) == 0 or ids[-1] != self.eos_id)
            ):
                ids = np.append(ids, self.eos_id)
                mask = np.append(mask, mask[-1] if len(mask) else mask.dtype.type(0))
            if limit is not None and len(ids) > limit:
                if strategy == "drop":
                    stats.dropped_documents += 1
                    stats.lost_tokens += len(ids)
                    continue
                stats.truncated_documents += 1
                stats.lost_tokens += len(ids) - limit
                keep = slice(-limit, None) if from_left else slice(limit)
                ids, mask = ids[keep], mask[keep]
            if not mask.any():
                stats.dropped_no_trainable += 1
                stats.lost_tokens += len(ids)
                continue
            keep_ids.append(ids)
            keep_masks.append(mask)
            doc_index.append(i)
        return self._encoded(keep_ids, keep_masks, doc_index, None, stats, failed)

    def _encoded(
        self, keep_ids: list[np.ndarray], keep_masks: list[np.ndarray], doc_index: list[int],
        piece: np.ndarray | None, stats: Any, failed: Any,
    ) -> Encoded:  # fmt: skip
        """The kept sequences as one ``Encoded``, counted in ``stats`` (piece 0 unless given).

        ``keep_masks`` are bool masks, or float32 loss weights (message weights) kept as such.
        """
        lengths = np.fromiter(map(len, keep_ids), dtype=np.int64, count=len(keep_ids))
        tokens = (np.concatenate(keep_ids) if keep_ids else np.zeros(0)).astype(self.dtype)
        empty = np.zeros(0, np.float32 if self.options.weight_field is not None else bool)
        mask = np.concatenate(keep_masks) if keep_masks else empty
        stats.sequences += len(lengths)
        stats.tokens += int(lengths.sum())
        stats.trainable_tokens += int(np.count_nonzero(mask))
        if piece is None:
            piece = np.zeros(len(lengths), dtype=np.int32)
        return Encoded(
            tokens, lengths, np.asarray(doc_index, dtype=np.int64), piece, mask=mask,
            failed=failed,
        )  # fmt: skip

    def _lint_sample(self, ids: np.ndarray, mask: np.ndarray) -> None:
        mask = mask > 0  # (float32 loss weights of a weighted pair's side)
        bos = self.bos_id if self.bos_id is not None else getattr(self.hf, "bos_token_id", None)
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            self.lint.double_bos += 1
        if self.unk_id is not None:
            self.lint.unknown_tokens += int((ids == self.unk_id).sum())
        # the last trainable token that is not whitespace must be EOS / an end-of-turn token
        if not mask.any():
            return
        pos = len(mask) - 1 - int(np.argmax(mask[::-1]))
        while pos >= 0 and mask[pos]:
            token = int(ids[pos])
            if token in self.special_set:
                break
            if self.backend.decode([token], skip_special_tokens=False).strip():
                self.lint.missing_end_of_turn += 1
                break
            pos -= 1


def bos_added_by_post_processor(text: Any) -> int | None:
    """The BOS id if the backend's post-processor prepends it (with special tokens on)."""
    if not text.add_special_tokens:
        return None
    with_specials = text.backend.encode("x", add_special_tokens=True).ids
    without = text.backend.encode("x", add_special_tokens=False).ids
    if len(with_specials) > len(without) and with_specials[: len(without)] != without:
        return int(with_specials[0])
    return None
