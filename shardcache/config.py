"""Build options: frozen dataclasses, validated at construction.

A recipe (TOML) and the CLI flags both end up here, so every check lives in one place and
every message names the field, the value and the allowed range. Only the tokenize and chat
options (with the data) enter the cache key; layout and encoder choice never do.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardcache.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def read_toml(path: str, what: str) -> dict[str, Any]:
    """Parse a TOML file (a build or mixture recipe); ConfigError messages call it ``what``."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"{what} {path!r}: cannot read it ({err})") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{what} {path!r}: not valid TOML ({err})") from err
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what} {path!r}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); TOML files are UTF-8: save it as UTF-8"
        ) from err


TRUNCATION_STRATEGIES = ("truncate", "drop", "split")
COMPRESSIONS = ("none", "zstd")
ON_ERROR = ("skip", "fail")
TRAIN_ON = ("assistant", "last-assistant", "all")
TRUNCATION_SIDES = ("right", "left")
#: Which encoder backend tokenizes (builder/backends.py): ``auto`` the accelerated one when it
#: is installed, supports the tokenizer and passes the gate, else Hugging Face; ``hf`` always
#: the Hugging Face tokenizer; ``fast`` the accelerated one or fail, saying why.
ENCODERS = ("auto", "hf", "fast")
#: Share of documents that the in-build check re-encodes with the Hugging Face tokenizer when
#: the accelerated backend is used: a random sample, raised for small corpora (the builder's
#: ``verify_rate``). HF is far slower than the fast backend: a larger share costs more than
#: the encode itself.
DEFAULT_VERIFY_FRACTION = 1 / 1000

#: Default bucket edges: powers of two. A sequence of length n goes to the first bucket whose
#: edge is >= n; longer ones go to a last, open-ended bucket.
DEFAULT_BUCKET_EDGES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

#: 64 MiB: large enough that per-file overhead is negligible, small enough that one shard per
#: open bucket fits comfortably in memory on a laptop.
DEFAULT_SHARD_SIZE_BYTES = 64 * 1024 * 1024

#: Uncompressed jsonl files and parquet files larger than this are cut into partitions of
#: about this size (line boundaries / row groups), so one big file still uses every worker.
#: Long enough that per-partition costs (a process round trip, a few small files) vanish,
#: short enough that a kill loses little.
DEFAULT_PARTITION_SIZE_BYTES = 256 * 1024 * 1024
MIN_PARTITION_SIZE_BYTES = 1024

#: More bad records than this fraction fails a build: a wrong --text-field or chat data built
#: as text quarantines every record, and an empty cache must not look like a success.
DEFAULT_MAX_BAD_FRACTION = 0.1


def check_int(field: str, value: object, low: int, high: int | None = None, unit: str = "") -> None:
    """Raise ConfigError unless ``value`` is an int (not a bool) in ``[low, high]``."""
    allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
    unit = f" {unit}" if unit else ""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        raise ConfigError(f"{field}: got {value!r}, expected an integer {allowed}{unit}")


def check_choice(field: str, value: object, valid: Sequence[str]) -> None:
    """Raise ConfigError unless ``value`` is one of ``valid``, suggesting the closest."""
    if value in valid:
        return
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{field}: got {value!r}, expected one of {', '.join(valid)}{hint}")


def check_fraction(field: str, value: object) -> None:
    """Raise ConfigError unless ``value`` is a number (not a bool) in ``[0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{field}: got {value!r}, expected a number in [0, 1] (a fraction)")


def check_known(what: str, given: Iterable[str], valid: Iterable[str], noun: str = "key") -> None:
    """Raise ConfigError naming each name of ``given`` not in ``valid``, with the closest."""
    valid = sorted(valid)
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), valid, n=1)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    plural = "s" if len(unknown) > 1 else ""
    raise ConfigError(
        f"{what}: unknown {noun}{plural} {', '.join(parts)}; valid {noun}s: {', '.join(valid)}"
    )


def default_workers() -> int:
    """The CPU cores this process may use (its affinity on Linux): the default ``--workers``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ChatOptions:
    """How conversations are rendered and masked; all part of the cache key."""

    messages_field: str = "messages"
    template_path: str | None = None  # None: the tokenizer's own chat_template
    train_on: str = "assistant"
    truncation_side: str = "right"
    lint_sample: int = 32  # conversations per partition compared with apply_chat_template
    #: preference pairs ({"prompt", "chosen", "rejected"}) instead of conversations
    preference: bool = False
    #: preference: the longest prompt in tokens (None: no limit); a longer one is cut from the
    #: left (``truncation = "truncate"``) or its pair dropped (``"drop"``)
    max_prompt_length: int | None = None
    #: the message field holding a per-message loss weight (axolotl's ``weight``: a number in
    #: [0, 1], absent = 1); None: weights are not read and the cache stores none
    weight_field: str | None = None
    #: preference: keep pairs whose chosen and rejected encode alike (quarantined as
    #: ``identical_sides`` by default: such a pair teaches nothing)
    keep_identical_pairs: bool = False

    def __post_init__(self) -> None:
        if not self.messages_field:
            raise ConfigError("messages_field: must be a non-empty field name, got ''")
        if self.weight_field is not None:
            if not isinstance(self.weight_field, str) or not self.weight_field:
                raise ConfigError(
                    f"weight_field: must be a non-empty message field name (e.g. 'weight'), "
                    f"got {self.weight_field!r}"
                )
            if self.train_on == "all":
                raise ConfigError(
                    f"weight_field: got {self.weight_field!r} with train_on = 'all'; a weight "
                    "scales the tokens of a trainable message, and 'all' trains on the template "
                    "text between messages too: use train_on = 'assistant' or 'last-assistant'"
                )
        check_choice("train_on", self.train_on, TRAIN_ON)
        if self.preference and self.train_on == "all":
            raise ConfigError(
                "train_on: 'all' would train on the prompt of preference pairs; only the "
                "completion carries a loss there, so leave train_on unset"
            )
        check_choice("truncation_side", self.truncation_side, TRUNCATION_SIDES)
        if self.preference and self.truncation_side != "right":
            raise ConfigError(
                f"truncation_side: got {self.truncation_side!r} for preference data; a pair's "
                "prompt is cut from the left (max_prompt_length) and its completions from the "
                "right (max_length), so leave truncation_side unset"
            )
        if not isinstance(self.keep_identical_pairs, bool):
            raise ConfigError(
                f"keep_identical_pairs: got {self.keep_identical_pairs!r}, expected true or false"
            )
        if self.keep_identical_pairs and not self.preference:
            raise ConfigError(
                "keep_identical_pairs: true for chat data; it keeps preference pairs whose "
                'chosen and rejected are the same (kind = "preference") only: leave it out'
            )
        if self.max_prompt_length is not None:
            if not self.preference:
                raise ConfigError(
                    f"max_prompt_length: got {self.max_prompt_length!r} for chat data; it "
                    'limits the prompt of preference pairs only (kind = "preference"): use '
                    "max_length"
                )
            check_int("max_prompt_length", self.max_prompt_length, 1, unit="tokens")
            if self.train_on != "assistant":
                raise ConfigError(
                    f"max_prompt_length: needs train_on = 'assistant' (got {self.train_on!r}): "
                    "a pair's prompt is every token before its first trainable one"
                )
        if self.template_path is not None and not os.path.isfile(self.template_path):
            raise ConfigError(
                f"chat_template: {self.template_path!r} is not a file; give a Jinja template "
                "file or leave it unset to use the tokenizer's chat_template"
            )
        check_int("lint_sample", self.lint_sample, 0)


@dataclass(frozen=True)
class SourceOptions:
    """Where records come from.

    Args:
        inputs: files, folders or globs, local or URLs (one string is accepted).
        text_field: the record field holding the text.
        on_error: ``"skip"`` bad records (counted and quarantined) or ``"fail"``.
        exclude: glob patterns of files to leave out; a pattern matches a file's name or its
            path as listed (one string is accepted).

    Raises:
        ConfigError: a field is invalid.
    """

    inputs: tuple[str, ...]
    text_field: str = "text"
    on_error: str = "skip"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            object.__setattr__(self, "inputs", (self.inputs,))
        object.__setattr__(self, "inputs", tuple(str(p) for p in self.inputs))
        if not self.inputs:
            raise ConfigError("inputs: no input given; pass --input PATH (file, folder or glob)")
        if not self.text_field:
            raise ConfigError("text_field: must be a non-empty field name, got ''")
        check_choice("on_error", self.on_error, ON_ERROR)
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        if not all(isinstance(p, str) and p for p in exclude):
            raise ConfigError(
                f"exclude: got {list(exclude)!r}, expected non-empty glob patterns such as "
                "'expected.json' or '*.json'"
            )
        object.__setattr__(self, "exclude", exclude)


@dataclass(frozen=True)
class TokenizeOptions:
    """How text becomes ids; all part of the cache key.

    Args:
        tokenizer: a tokenizer folder or hub name.
        add_special_tokens: let the tokenizer add its special tokens (None: its default).
        append_eos: append the end-of-sequence id.
        max_length: the longest sequence in tokens, at least 2 (None: no limit).
        truncation: ``"truncate"``, ``"drop"`` or ``"split"`` for longer documents.

    Raises:
        ConfigError: a field is invalid.
    """

    tokenizer: str
    add_special_tokens: bool | None = None  # None: what the tokenizer does by default
    append_eos: bool = True
    max_length: int | None = None
    truncation: str = "truncate"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", str(self.tokenizer))
        if not self.tokenizer:
            raise ConfigError("tokenizer: no tokenizer given; pass --tokenizer FOLDER")
        if self.max_length is not None and (
            not isinstance(self.max_length, int) or self.max_length < 2
        ):
            raise ConfigError(
                f"max_length: got {self.max_length!r}, expected an integer >= 2 (or unset)"
            )
        check_choice("truncation", self.truncation, TRUNCATION_STRATEGIES)


@dataclass(frozen=True)
class EncodingOptions:
    """Encoder backend and its share re-checked with HF; never changes the bytes, not in the key."""

    encoder: str = "auto"
    verify_fraction: float = DEFAULT_VERIFY_FRACTION

    def __post_init__(self) -> None:
        check_choice("encoder", self.encoder, ENCODERS)
        value = self.verify_fraction
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(
                f"verify_fraction: got {value!r}, expected a number in [0, 1] (the share of "
                "documents re-encoded with the Hugging Face tokenizer, e.g. 0.001 = 1/1000)"
            )
        object.__setattr__(self, "verify_fraction", float(value))


@dataclass(frozen=True)
class LayoutOptions:
    """How sequences are laid out on disk; not part of the cache key.

    Args:
        bucket_edges: upper length of each bucket, strictly increasing.
        shard_size_bytes: target token bytes per shard (at least 4096).
        compression: ``"none"`` or ``"zstd"``.

    Raises:
        ConfigError: a field is invalid.
    """

    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES
    compression: str = "none"

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.bucket_edges)
        object.__setattr__(self, "bucket_edges", edges)
        if not edges:
            raise ConfigError("buckets: at least one bucket edge is needed, got none")
        if any(e < 1 for e in edges) or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ConfigError(
                f"buckets: edges must be positive and strictly increasing, got {list(edges)}"
            )
        check_int("shard_size", self.shard_size_bytes, 4096, unit="bytes")
        check_choice("compression", self.compression, COMPRESSIONS)


@dataclass(frozen=True)
class BuildOptions:
    """Everything one build needs.

    Args:
        source: where the records come from.
        tokenize: how text becomes ids (part of the cache key).
        output: the cache folder (local path or URL).
        layout: how sequences are laid out on disk.
        batch_docs: documents per tokenizer call.
        force: start over, discarding a committed cache or an interrupted build at ``output``.
        data_version: names the data in the cache key instead of the input files' hashes.
        workers: processes that run partitions (None: the usable cores); never changes the
            output bytes and is not recorded in the manifest.
        partition_size_bytes: uncompressed jsonl / parquet inputs larger than this are split
            into partitions of about this size.
        chat: chat data (rendered with a template, with loss masks); None: plain text.
        strict_lint: fail the build (no manifest) when the chat lint finds any problem.
        max_bad_fraction: fail the build (no manifest) when more than this fraction of the
            records is bad; a build that keeps no document always fails.
        encoding: encoder backend and its in-build verification (never changes the bytes).

    Raises:
        ConfigError: a field is invalid.
    """

    source: SourceOptions
    tokenize: TokenizeOptions
    output: str
    layout: LayoutOptions = field(default_factory=LayoutOptions)
    batch_docs: int = 1024
    force: bool = False
    data_version: str | None = None
    workers: int | None = None
    partition_size_bytes: int = DEFAULT_PARTITION_SIZE_BYTES
    chat: ChatOptions | None = None
    strict_lint: bool = False
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION
    encoding: EncodingOptions = field(default_factory=EncodingOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", os.fspath(self.output))
        if not self.output:
            raise ConfigError("output: no output folder given; pass --output FOLDER")
        if not isinstance(self.batch_docs, int) or self.batch_docs < 1:
            raise ConfigError(f"batch_docs: got {self.batch_docs!r}, expected an integer >= 1")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise ConfigError(
                f"workers: got {self.workers!r}, expected an integer >= 1 (or unset: all cores)"
            )
        check_pair_limits(self.tokenize.max_length, self.chat)
        if (
            not isinstance(self.partition_size_bytes, int)
            or self.partition_size_bytes < MIN_PARTITION_SIZE_BYTES
        ):
            raise ConfigError(
                f"partition_size: got {self.partition_size_bytes!r} bytes, expected an integer "
                f">= {MIN_PARTITION_SIZE_BYTES}"
            )

        check_fraction("max_bad_fraction", self.max_bad_fraction)

    @property
    def kind(self) -> str:
        """The data kind: ``"text"``, ``"chat"`` or ``"preference"``."""
        if self.chat is None:
            return "text"
        return "preference" if self.chat.preference else "chat"

    @property
    def num_workers(self) -> int:
        """``workers``, with None resolved to the number of usable cores."""
        return self.workers if self.workers is not None else default_workers()

    def to_json(self) -> dict[str, Any]:
        """The options as plain JSON, nested per option group (recorded in the manifest).

        Returns:
            The fields by name, each option group a dict of its own.
        """
        return dataclasses.asdict(self)


def check_pair_limits(max_length: int | None, chat: ChatOptions | None) -> None:
    """Raise ConfigError unless a pair's prompt limit leaves room for its completions."""
    prompt = chat.max_prompt_length if chat is not None else None
    if prompt is not None and max_length is not None and prompt >= max_length:
        raise ConfigError(
            f"max_prompt_length: got {prompt} with max_length {max_length}; a pair's completions "
            "get max_length minus its prompt, so give a max_prompt_length below max_length"
        )


def parse_size(value: str | int, name: str = "shard_size") -> int:
    """Bytes of a size such as ``4096``, ``64MB``, ``64MiB`` or ``1G`` (an int passes as is).

    ``k``/``m``/``g`` alone are binary (like ``KiB``); ``kb``/``mb``/``gb`` are decimal.
    """
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    units = {
        "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
        "kb": 1000, "mb": 1000**2, "gb": 1000**3,
        "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1,
    }  # fmt: skip
    for suffix, unit in units.items():
        if text.endswith(suffix):
            number, factor = text[: -len(suffix)], unit
            break
    else:
        number, factor = text, 1
    try:
        return int(float(number) * factor)
    except ValueError:
        raise ConfigError(
            f"{name}: cannot read {value!r} as a size; use bytes or a suffix like 64MiB"
        ) from None


def parse_buckets(value: str | Sequence[int]) -> tuple[int, ...]:
    """Bucket edges from ``"128,512,2048"`` or ints; ``LayoutOptions`` checks them."""
    if isinstance(value, str):
        try:
            return tuple(int(v) for v in value.replace(" ", "").split(",") if v)
        except ValueError:
            raise ConfigError(
                f"buckets: cannot read {value!r}; give comma-separated integers like 256,1024"
            ) from None
    return tuple(int(v) for v in value)


RECIPE_KEYS = {
    "input", "text_field", "on_error", "tokenizer", "add_special_tokens", "append_eos",
    "max_length", "truncation", "buckets", "shard_size", "compression", "output", "batch_docs",
    "data_version", "workers", "partition_size", "chat", "messages_field", "chat_template",
    "train_on", "truncation_side", "strict_lint", "max_bad_fraction", "encoder",
    "verify_fraction", "exclude", "kind", "preference", "max_prompt_length", "weight_field",
    "keep_identical_pairs",
}  # fmt: skip


CHAT_KEYS = ("messages_field", "chat_template", "train_on", "truncation_side", "weight_field")


#: The data kinds a cache may hold (its manifest's ``kind``): the one list every layer reads.
KINDS = ("text", "chat", "preference")


def data_kind(values: Mapping[str, Any]) -> str:
    """The data kind of flat recipe/CLI values: ``kind``, or ``chat`` / ``preference`` flags."""
    kind = values.get("kind")
    if kind is not None:
        check_choice("kind", kind, KINDS)
    if values.get("preference"):
        if kind not in (None, "preference"):
            raise ConfigError(f"kind: got {kind!r} with preference = true; give one of them")
        return "preference"
    if kind is not None:
        return str(kind)
    return (
        "chat"
        if values.get("chat") or any(values.get(k) is not None for k in CHAT_KEYS)
        else "text"
    )


def chat_options_from_mapping(values: Mapping[str, Any]) -> ChatOptions | None:
    """Chat options of flat recipe/CLI values; None for plain text.

    Preference data (``kind = "preference"`` or ``preference``) are chat options with
    ``preference`` set: message lists render with the chat template.
    """
    kind = data_kind(values)
    if kind != "preference" and values.get("max_prompt_length") is not None:
        raise ConfigError(
            f"max_prompt_length: got {values['max_prompt_length']!r} for {kind} data; it "
            'limits the prompt of preference pairs only (kind = "preference"): use max_length'
        )
    keep_identical = values.get("keep_identical_pairs")
    if kind != "preference" and keep_identical:
        raise ConfigError(
            f"keep_identical_pairs: true for {kind} data; it keeps preference pairs whose "
            'chosen and rejected are the same (kind = "preference") only: leave it out'
        )
    if kind == "text":
        return None
    if kind == "preference" and values.get("messages_field") is not None:
        raise ConfigError(
            "messages_field: not used for preference data (records hold prompt, chosen and "
            "rejected); leave it out"
        )
    chat = ChatOptions(
        messages_field=values.get("messages_field") or "messages",
        template_path=values.get("chat_template"),
        train_on=values.get("train_on") or "assistant",
        truncation_side=values.get("truncation_side") or "right",
        preference=kind == "preference",
        max_prompt_length=values.get("max_prompt_length"),
        weight_field=values.get("weight_field") or None,
        keep_identical_pairs=False if keep_identical is None else keep_identical,
    )
    check_pair_limits(values.get("max_length"), chat)
    return chat


def tokenize_options_from_mapping(values: Mapping[str, Any]) -> TokenizeOptions:
    """Tokenizer and truncation options of flat recipe/CLI values (for check, lock, expect).

    ``append_eos`` defaults to True for text and False for chat data (chat templates write their
    own end-of-turn markers).
    """
    if values.get("tokenizer") in (None, ""):
        raise ConfigError("tokenizer: not given; pass --tokenizer FOLDER or a recipe with one")
    kind = data_kind(values)
    chat = kind == "chat"
    append_eos = values.get("append_eos")
    if kind == "preference":
        truncation = values.get("truncation") or "drop"
        if truncation == "split":
            raise ConfigError(
                "truncation: 'split' is for plain text (a piece of a pair has no prompt); use "
                "drop (a pair over the limits is dropped whole, the default) or truncate (the "
                "prompt cut from the left to max_prompt_length, both completions to max_length)"
            )
    else:
        truncation = values.get("truncation") or "truncate"
    if chat and truncation == "split":
        raise ConfigError(
            "truncation: 'split' is for plain text (a piece of a conversation has no prompt); "
            "use truncate (with --truncation-side) or drop for chat data"
        )
    return TokenizeOptions(
        tokenizer=values["tokenizer"],
        add_special_tokens=values.get("add_special_tokens"),
        append_eos=(not chat) if append_eos is None else bool(append_eos),
        max_length=values.get("max_length"),
        truncation=truncation,
    )


def build_options_from_mapping(values: Mapping[str, Any]) -> BuildOptions:
    """``BuildOptions`` of flat recipe/CLI values (None: not given); unknown keys fail."""
    check_known("recipe", values, RECIPE_KEYS)
    missing = [k for k in ("input", "tokenizer", "output") if values.get(k) in (None, "", ())]
    if missing:
        raise ConfigError(
            f"build: missing {', '.join(missing)}; give them in the recipe or as "
            + ", ".join(f"--{k}" for k in missing)
        )
    inputs = values["input"]
    layout_kwargs: dict[str, Any] = {}
    if values.get("buckets") is not None:
        layout_kwargs["bucket_edges"] = parse_buckets(values["buckets"])
    if values.get("shard_size") is not None:
        layout_kwargs["shard_size_bytes"] = parse_size(values["shard_size"])
    if values.get("compression") is not None:
        layout_kwargs["compression"] = values["compression"]
    chat = chat_options_from_mapping(values)
    if chat is not None and values.get("text_field"):
        raise ConfigError("text_field: not used for chat data; give messages_field instead")
    return BuildOptions(
        source=SourceOptions(
            inputs=(inputs,) if isinstance(inputs, str) else tuple(inputs),
            text_field=chat.messages_field if chat else values.get("text_field") or "text",
            on_error=values.get("on_error") or "skip",
            exclude=values.get("exclude") or (),
        ),
        tokenize=tokenize_options_from_mapping(values),
        output=values["output"],
        layout=LayoutOptions(**layout_kwargs),
        batch_docs=int(values.get("batch_docs") or 1024),
        data_version=None if values.get("data_version") is None else str(values["data_version"]),
        workers=values.get("workers"),
        **(
            {"partition_size_bytes": parse_size(values["partition_size"], "partition_size")}
            if values.get("partition_size") is not None
            else {}
        ),
        chat=chat,
        strict_lint=bool(values.get("strict_lint", False)),
        **(
            {"max_bad_fraction": values["max_bad_fraction"]}
            if values.get("max_bad_fraction") is not None
            else {}
        ),
        encoding=encoding_options_from_mapping(values),
    )


def encoding_options_from_mapping(values: Mapping[str, Any]) -> EncodingOptions:
    """Encoding options of flat recipe/CLI values (a fraction may be ``"1/64"``)."""
    fraction: Any = values.get("verify_fraction")
    if fraction is None:
        fraction = DEFAULT_VERIFY_FRACTION
    elif isinstance(fraction, str):
        fraction = parse_fraction(fraction)
    return EncodingOptions(encoder=values.get("encoder") or "auto", verify_fraction=fraction)


def parse_fraction(value: str, name: str = "verify_fraction") -> float:
    """``"0.02"`` or ``"1/64"`` as a float; the options that take it check the range."""
    text = value.strip()
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(
            f"{name}: got {value!r}, expected a number in [0, 1] such as 0.02 or 1/64"
        ) from None
