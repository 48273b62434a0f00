"""The ``shardcache`` command line.

Translates errors at the boundary: ``ConfigError`` becomes a usage error (exit 2), every other
``ShardcacheError`` a failure (exit 1) with its message; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from shardcache.errors import ConfigError, ShardcacheError
from shardcache.version import __version__

F = TypeVar("F", bound=Callable[..., Any])


def _exit_now(signum: int, frame: Any) -> None:
    os._exit(130)  # a second Ctrl-C: no cleanup (workers die with this process)


@contextlib.contextmanager
def interruptible(what: str) -> Iterator[None]:
    """Ctrl-C for a long command: exit 130 printing ``what`` to do; a second one exits at once."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ):
        yield
        return

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, _exit_now)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: {what}", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, previous)


def translate_errors(func: F) -> F:
    """Wrap a command's callback so shardcache errors exit 2 (``ConfigError``) or 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ConfigError as err:
            raise click.UsageError(str(err)) from err
        except ShardcacheError as err:
            raise click.ClickException(str(err)) from err

    return wrapper  # type: ignore[return-value]


class RegistryChoice(click.Choice):
    """A choice among the names a registry holds, read each time click needs them.

    The registry's module is imported then, not with the CLI (``shardcache info`` stays free of
    the read layer), and a name registered after the CLI was imported is a valid choice.
    """

    def __init__(self, names: Callable[[], tuple[str, ...]]) -> None:
        self.names = names
        super().__init__((), case_sensitive=True)

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        """The registry's names now."""
        return tuple(self.names())

    @choices.setter
    def choices(self, value: object) -> None:
        """Ignore ``click.Choice``'s own list: the registry is the only one."""


def _plan_modes() -> tuple[str, ...]:
    from shardcache.read.plan.policies import modes

    return modes()


def _packings() -> tuple[str, ...]:
    from shardcache.read.plan.policies import packings

    return packings()


def _export_formats() -> tuple[str, ...]:
    from shardcache.store.export import EXPORTERS

    return tuple(EXPORTERS)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="shardcache")
def main() -> None:
    """Pre-tokenize a text corpus (plain text or chat) once into verified, versioned shards.

    \b
    Typical use:
      shardcache build recipes/quickstart.toml      # build a cache from a recipe
      shardcache build --input data/ --tokenizer tok/ --output cache/ --max-length 2048
      shardcache info cache/                          # what is in it
      shardcache verify cache/                        # recompute every checksum
      shardcache lock recipes/quickstart.toml         # write shardcache.lock for CI
      shardcache check --lock shardcache.lock recipes/quickstart.toml   # still matching?
      shardcache mix recipes/mixture.toml             # what each cache of a mixture gives
      shardcache profile cache/ --step-ms 200         # where a training step waits

    Exit codes: 0 success, 1 failure, 2 usage error. Shell completion: see the README
    (eval "$(_SHARDCACHE_COMPLETE=bash_source shardcache)").
    """  # noqa: D301 - click's \b (keep this block unwrapped) must be a real backspace


class _BarProgress:
    """One tqdm bar over input bytes (so its ETA is the build's), with documents and tokens/s."""

    def __init__(self, enabled: bool, label: str = "build"):
        self.enabled = enabled
        self.label = label
        self.bar: Any = None
        self.documents = 0
        self.tokens = 0

    def start(self, total_bytes: int, files: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{self.label} ({files} files)",
            disable=not self.enabled,
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def advance(self, n_bytes: int) -> None:
        if self.bar is not None:
            self.bar.update(n_bytes)

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        if self.bar is not None and self.enabled:
            elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(
                f"{self.documents:,} docs, {self.tokens / 1e6:,.1f} Mtok, "
                f"{self.tokens / elapsed / 1e6:.2f} Mtok/s",
                refresh=False,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def key_options(func: F) -> F:
    """Add the flags that decide the cache key (shared by build, check and lock)."""
    from shardcache.builder.inputs import formats_help

    options = [
        click.option(
            "--input", "-i", "inputs", multiple=True,
            help="Input file, folder or glob. Formats by suffix: " + formats_help() + ". JSON "
            "files hold lines or one array of objects; a text file is one document, read when "
            "named or globbed (a glob's files of no other format are text, e.g. 'src/**/*.py'); "
            "a datasets save_to_disk folder is read as its data files. "
            "Repeatable. Processed in sorted order.",
        ),
        click.option(
            "--exclude", multiple=True, metavar="GLOB",
            help="Leave out input files whose name, or path as listed (relative to a folder "
            "input), matches this glob, e.g. 'expected.json' or 'meta/*'. Repeatable.",
        ),
        click.option("--tokenizer", "-t", help="Local folder of a fast Hugging Face tokenizer."),
        click.option("--text-field", help="Field holding the text in each record. "
                     "[default: text]"),
        click.option(
            "--add-special-tokens/--no-add-special-tokens", default=None,
            help="Let the tokenizer add its special tokens (e.g. BOS, [CLS]).  "
            "[default: what the tokenizer does]",
        ),
        click.option(
            "--append-eos/--no-append-eos", default=None,
            help="Append EOS (or SEP when there is no EOS) unless the sequence already ends "
            "with it.  [default: append]",
        ),
        click.option("--max-length", type=click.IntRange(min=2),
                     help="Longest sequence to store, in tokens (EOS included)."),
        click.option(
            "--truncation", type=click.Choice(["truncate", "drop", "split"]),
            help="What to do with longer sequences: keep the first max-length tokens, drop "
            "the document, or split it into consecutive pieces. Preference pairs: truncate "
            "cuts the prompt to its last --max-prompt-length tokens and both completions to "
            "what max-length leaves, drop drops the pair.  [default: truncate; pairs: drop]",
        ),
        click.option("--chat", is_flag=True, default=None, help="Chat data: render each "
                     "record's messages with a chat template and store loss masks."),
        click.option("--preference", is_flag=True, default=None, help="Preference pairs: "
                     "records {prompt, chosen, rejected} (strings or message lists) or {chosen, "
                     "rejected} sharing a prompt, stored "
                     "as two masked sequences per pair, loss on the completion only."),
        click.option("--max-prompt-length", type=click.IntRange(min=1),
                     help="Preference: the longest prompt, in tokens (below --max-length); "
                     "a longer one is cut from the left or its pair dropped (--truncation)."),
        click.option("--keep-identical-pairs", is_flag=True, default=None,
                     help="Preference: keep pairs whose chosen and rejected encode alike.  "
                     "[default: quarantined as identical_sides]"),
        click.option("--messages-field", help="Chat: field holding the list of {role, content} "
                     "messages.  [default: messages]"),
        click.option("--chat-template", type=click.Path(dir_okay=False), help="Chat: a Jinja "
                     "template file.  [default: the tokenizer's chat_template]"),
        click.option("--train-on", type=click.Choice(["assistant", "last-assistant", "all"]),
                     help="Chat: which tokens carry a loss.  [default: assistant]"),
        click.option("--truncation-side", type=click.Choice(["right", "left"]),
                     help="Chat: which end of a long conversation is cut.  [default: right]"),
        click.option("--weight-field", help="Chat: read a per-message loss weight in [0, 1] "
                     "from this message field (axolotl: weight; absent = 1) and store it per "
                     "token; batches carry loss_weights.  [default: weights not read]"),
        click.option("--data-version", help="A version name for the data, recorded in the "
                     "cache key instead of the input files' hashes."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def _values(recipe: str | None, inputs: tuple[str, ...], flags: dict[str, Any]) -> dict[str, Any]:
    from shardcache.recipe import load_recipe, merge

    values = load_recipe(recipe) if recipe else {}
    return merge(values, {"input": inputs, **flags})


@main.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False))
@key_options
@click.option("--output", "-o", help="Cache folder to write.")
@click.option(
    "--buckets",
    help="Comma-separated bucket edges, e.g. 128,512,2048 (a sequence "
    "goes to the first bucket whose edge is >= its length).  "
    "[default: 64,128,...,32768]",
)
@click.option("--shard-size", help="Target shard size, e.g. 64MiB.  [default: 64MiB]")
@click.option(
    "--compression", type=click.Choice(["none", "zstd"]), help="Shard compression.  [default: none]"
)
@click.option(
    "--on-error",
    type=click.Choice(["skip", "fail"]),
    help="Bad records: skip them (counted, written to quarantine.jsonl) or fail.  [default: skip]",
)
@click.option(
    "--batch-docs",
    type=click.IntRange(min=1),
    help="Documents per tokenizer call.  [default: 1024]",
)
@click.option(
    "--workers",
    "-w",
    type=click.IntRange(min=1),
    help="CPU cores that build partitions: processes, except that a text build on the fast "
    "backend runs up to 2 in this process, in threads sharing one tokenizer (1: in this "
    "process). Never changes the output bytes.  [default: the machine's cores]",
)
@click.option(
    "--partition-size",
    help="Split uncompressed jsonl and parquet inputs larger than this into partitions "
    "(line boundaries / row groups), e.g. 256MiB.  [default: 256MiB]",
)
@click.option(
    "--strict-lint",
    is_flag=True,
    default=None,
    help="Chat: fail the build (no manifest) when the lint finds double BOS, a missing "
    "end-of-turn, unknown tokens, span boundary tokens or template mismatches.",
)
@click.option(
    "--max-bad-fraction",
    type=click.FloatRange(0, 1),
    help="Fail the build (no manifest) when more than this fraction of the records is bad; "
    "a build that keeps no document always fails.  [default: 0.1]",
)
@click.option(
    "--encoder",
    type=click.Choice(["auto", "hf", "fast"]),
    help="Tokenizer backend: auto uses a fast one (fastokens or gigatoken from pip install "
    "'shardcache[fast]'; BERT-style WordPiece, and T5-style tokenizers that split at "
    "whitespace or at a Metaspace marker: shardcache's own) when "
    "it supports the tokenizer and gives HF's exact ids on the probe set and a corpus "
    "sample, else HF (the reason is in the report); hf always HF; fast fails, saying why, "
    "when the fast one cannot be used or disagrees. Never changes the output bytes.  "
    "[default: auto]",
)
@click.option(
    "--verify-fraction",
    help="Fast encoder: share of the documents re-encoded with HF and compared (a random "
    "sample, at least 64 KiB of input's worth; 0: none); a mismatch re-encodes the "
    "partition with HF (--encoder fast: fails), e.g. 0.01 or 1/64.  [default: 1/1000]",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where partitions run: a local process pool, or Ray tasks (pip install "
    "'shardcache[ray]'). Never changes the output bytes.",
)
@click.option("--ray-address", help="Join this Ray cluster (e.g. auto, ray://head:10001) "
              "instead of starting a local one with --workers CPUs.")  # fmt: skip
@click.option(
    "--partition",
    "share",
    metavar="I/N",
    help="Job arrays: build only share I of N (partitions whose index is I mod N) and do "
    "not commit; then run `shardcache commit OUTPUT`.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Start over: discard a committed cache or an interrupted build at --output "
    "(never breaks another live build's lock).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the final report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; a one-line report, plus a "
              "line per problem (bad records, lost input, ids that differed from HF).")  # fmt: skip
@translate_errors
def build(
    recipe: str | None,
    inputs: tuple[str, ...],
    force: bool,
    as_json: bool,
    quiet: bool,
    engine: str,
    ray_address: str | None,
    share: str | None,
    **flags: Any,
) -> None:
    """Tokenize a corpus into a cache (from a RECIPE file and/or flags).

    Flags override the recipe; relative paths in a recipe are relative to its folder. The
    manifest is written last, so an interrupted build leaves no readable cache; rerunning the
    same command resumes it from its completed partitions (same bytes as an uninterrupted build).

    What transformers resolves from a text build's tokenizer folder (backend JSON, special
    tokens) is remembered in $SHARDCACHE_CACHE_DIR/tokenizers/ (keyed by the folder's files and
    the library versions, used only when it agrees with them), so later builds skip
    transformers; SHARDCACHE_NO_MEMO=1 bypasses it.

    \b
    Example:
      shardcache build --input corpus/ --tokenizer ./tok --output ./cache \\
          --max-length 2048 --truncation split --compression zstd --workers 8
    """  # noqa: D301
    import dataclasses

    from shardcache.builder.engines import EngineOptions, Share
    from shardcache.builder.report import format_report, report_json
    from shardcache.builder.run import build as run_build
    from shardcache.config import build_options_from_mapping

    values = _values(recipe, inputs, flags)
    options = dataclasses.replace(build_options_from_mapping(values), force=force)
    try:
        run = EngineOptions(engine, ray_address, Share.parse(share) if share else None)
    except ConfigError as err:
        raise click.BadParameter(str(err)) from err
    progress = _BarProgress(enabled=not quiet and not as_json)
    resume = "completed partitions are kept; rerun the same command to resume"
    with interruptible(resume):
        report = run_build(options, run, progress=progress)  # type: ignore[arg-type]
    if as_json:
        click.echo(json.dumps(report_json(report), indent=1))
    else:
        click.echo(format_report(report, brief=quiet))
    if run.share is not None:
        click.echo(
            f"share {run.share.index}/{run.share.count} done; when every share is, run "
            f"`shardcache commit {options.output}`",
            err=True,
        )


@main.command("commit")
@click.argument("output")
@click.option("--json", "as_json", is_flag=True, help="Print the final report as JSON.")
@click.option("--strict-lint", is_flag=True, help="Chat: refuse to commit when the shares' "
              "lint found double BOS, a missing end-of-turn, unknown tokens, span boundary "
              "tokens or template mismatches.")  # fmt: skip
@click.option("--max-bad-fraction", type=click.FloatRange(0, 1), help="Refuse to commit when "
              "more than this fraction of the records is bad.  [default: 0.1]")  # fmt: skip
@translate_errors
def commit_command(
    output: str, as_json: bool, strict_lint: bool, max_bad_fraction: float | None
) -> None:
    """Commit a job-array build: write the manifest of OUTPUT once every share is built.

    OUTPUT is the folder or URL all `shardcache build --partition I/N` runs wrote to. The
    options come from OUTPUT/parts/build.json (the tokenizer folder must exist here). Exits
    1 naming the missing partitions, and the shares that build them, when some are absent.

    \b
    Example (SLURM):
      sbatch --array=0-7 --wrap 'shardcache build recipe.toml --partition $SLURM_ARRAY_TASK_ID/8'
      shardcache commit ./cache
    """  # noqa: D301
    from shardcache.builder.commit import commit_output
    from shardcache.builder.report import format_report, report_json

    report = commit_output(output, strict_lint=strict_lint, max_bad_fraction=max_bad_fraction)
    if as_json:
        click.echo(json.dumps(report_json(report), indent=1))
    else:
        click.echo(format_report(report))


@main.command()
@click.argument("cache")
@click.option("--lengths", is_flag=True, help="Add a histogram of sequence lengths per bucket, "
              "with what --max-tokens costs in pad mode and fills in pack mode.")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(min=1), help="--lengths: the token budget "
              "whose padding is shown.  [default: 8 x the longest sequence]")  # fmt: skip
@click.option("--seq-len", type=click.IntRange(min=1), help="--lengths: the pack-mode row "
              "length.  [default: --max-tokens]")  # fmt: skip
@click.option("--bins", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="--lengths: histogram bins per bucket.")  # fmt: skip
@click.option("--plot", type=click.Path(dir_okay=False), help="--lengths: also write the "
              "histogram as a PNG (pip install 'shardcache[plot]' for matplotlib).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--split", "split_spec", default=None, metavar="NAME=FRACTION,...",
              help="Also count the documents, sequences and tokens of each side of a held-out "
              "split, e.g. validation=0.01,test=0.001 (seed=N and key=content|path optional): "
              "the sides ShardDataset(split=..., splits=Split(...)) reads, the key it draws "
              "documents by and the documents on more than one side (0 with content keys). "
              "Path keys (a cache built before content keys, or key=path) read every shard's "
              "record column.")  # fmt: skip
@translate_errors
def info(
    cache: str,
    lengths: bool,
    max_tokens: int | None,
    seq_len: int | None,
    bins: int,
    plot: str | None,
    as_json: bool,
    split_spec: str | None,
) -> None:
    """Summarize a CACHE: tokenizer, counts, truncation and bad-record counts, buckets.

    With --lengths, also a histogram of sequence lengths (BINS per bucket, from the length
    index: no shard is read), and for a token budget (--max-tokens) the padding one epoch of
    pad-mode batches would hold per bucket and the share of pack-mode (best_fit) slots that
    hold tokens, both planned as ShardDataset plans them. With --split, the documents,
    sequences and tokens of each side of a held-out split.

    \b
    Example:
      shardcache info ./cache --lengths --max-tokens 16384 --seq-len 4096
      shardcache info ./cache --lengths --plot lengths.png
      shardcache info ./cache --split validation=0.01,test=0.001
    """  # noqa: D301
    from shardcache.store.cache import open_cache
    from shardcache.store.summary import (
        cache_summary,
        format_histogram,
        format_summary,
        length_histogram,
        plot_histogram,
    )

    if not lengths and (max_tokens or seq_len or plot):
        raise click.BadParameter("needs --lengths", param_hint="--max-tokens/--seq-len/--plot")
    split = _parse_split(split_spec) if split_spec is not None else None
    with open_cache(cache) as opened:
        summary = cache_summary(opened)
        if split is not None:
            from shardcache.read.selection.splits import split_summary

            summary["splits"] = split_summary(opened, split)
        histogram = cost = None
        if lengths:
            histogram = length_histogram(opened, bins)
            if opened.num_sequences:
                cost = _length_cost(opened, max_tokens, seq_len)
            summary["lengths"] = {"histogram": histogram, **(cost or {})}
    if plot and histogram is not None:
        plot_histogram(histogram, plot)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        text = format_summary(summary)
        if histogram is not None:
            text += "\n\n" + format_histogram(histogram, cost)
        click.echo(text)
        if split is not None:
            from shardcache.read.selection.splits import format_split_summary

            click.echo("\n".join(format_split_summary(summary["splits"])))
        if plot:
            click.echo(f"wrote {plot}", err=True)


def _length_cost(opened: Any, max_tokens: int | None, seq_len: int | None) -> dict[str, Any]:
    """Pad-mode padding and pack-mode fill of one planned epoch at a token budget."""
    from shardcache.read.plan.padding_cost import pack_fill, pad_cost

    longest = int(opened.lengths.max())
    budget = max_tokens or 8 * longest
    row = seq_len or budget
    if longest > min(budget, row):
        raise ConfigError(
            f"--max-tokens {budget} / --seq-len {row}: the longest sequence holds {longest} "
            "tokens and must fit in a batch and a row; raise them"
        )
    buckets = opened.buckets()
    return {
        "max_tokens": budget,
        "pad": pad_cost(opened.lengths, buckets, budget),
        "pack": pack_fill(opened.lengths, buckets, budget, row),
    }


def _decoder(cache: Any, tokenizer: str | None) -> Callable[[Any], str]:
    """A ``decode(ids)`` of the cache's tokenizer (or ``--tokenizer``), warning when it differs."""
    from shardcache.errors import TokenizerError

    folder = tokenizer or str(cache.manifest["tokenizer"]["path"])
    path = folder if folder.endswith(".json") else os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        given = "--tokenizer" if tokenizer else "the build's tokenizer (recorded in the manifest)"
        raise TokenizerError(
            f"show: no tokenizer.json at {path!r} ({given}); decoding needs the tokenizer the "
            "cache was built with: pass --tokenizer FOLDER"
        )
    from tokenizers import Tokenizer

    from shardcache.builder.key_computation import tokenizer_component

    with open(path, encoding="utf-8") as f:
        backend = json.load(f)
    recorded = (cache.manifest.get("key") or {}).get("components", {}).get("tokenizer") or {}
    want = (recorded.get("model") or {}).get("sha256")
    got = tokenizer_component(backend, None, None)["model"]["sha256"]
    if want and want != got:
        click.echo(
            f"warning: the tokenizer at {path} is not the one the cache was built with (its "
            "vocabulary differs): the text shown may be wrong; pass --tokenizer FOLDER",
            err=True,
        )
    decoder = Tokenizer.from_str(json.dumps(backend))
    return lambda ids: decoder.decode(list(ids), skip_special_tokens=False)


def _show_batch(opened: Any, index: int, options: dict[str, Any]) -> dict[str, Any]:
    """Global batch ``index`` of an epoch at world size 1, as numpy arrays (``batch_json``)."""
    from shardcache.read.dataset import ShardDataset

    epoch = options.pop("epoch")
    attention = "none" if options.get("mode") == "pack" else None
    with ShardDataset(opened.path, rank=0, world_size=1, attention=attention, **options) as ds:
        ds.set_epoch(epoch)
        plan = ds.plan(epoch)
        if not 0 <= index < len(plan):
            raise ConfigError(
                f"--batch {index}: out of range, epoch {epoch} has {len(plan)} global batches "
                f"under these options (0..{len(plan) - 1})"
            )
        batch = ds.collate_batch(plan, index)
    meta = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in batch.pop("meta").items()}
    arrays = {k: v.numpy() for k, v in batch.items() if k != "attention_mask" or v.ndim == 2}
    return {**arrays, "meta": meta}


@main.command()
@click.argument("cache")
@click.option("--index", "-n", "indices", type=click.IntRange(min=0), multiple=True,
              help="Sample id to show (repeatable).")  # fmt: skip
@click.option("--sample", type=click.IntRange(min=1), help="Show this many sequences drawn at "
              "random (with --seed) from the cache or from --source.")  # fmt: skip
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of --sample and of the --batch plan.")  # fmt: skip
@click.option("--source", help="Only sequences from this input file (its path relative to the "
              "build's input root, as `info` and lookup() name it).")  # fmt: skip
@click.option("--record", type=click.IntRange(min=0), help="With --source: the document at "
              "this 0-based record index, every piece of it when it was split.")  # fmt: skip
@click.option("--tokens", "boundaries", is_flag=True, help="Show token boundaries (tokens "
              "decoded one by one, separated by │).")  # fmt: skip
@click.option("--tokenizer", "-t", help="Tokenizer folder to decode with.  [default: the "
              "build's, as recorded in the manifest]")  # fmt: skip
@click.option("--color/--no-color", default=None, help="Mark trainable tokens in colour "
              "instead of [[ ]].  [default: colour on a terminal]")  # fmt: skip
@click.option("--batch", "batch_index", type=click.IntRange(min=0), help="Show global batch "
              "N of an epoch as the model gets it (rows, documents, padding, labels), "
              "planned with the options below at world size 1.")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="--batch: the token budget of a batch.")  # fmt: skip
@click.option("--mode", type=RegistryChoice(_plan_modes), default="pad", show_default=True,
              help="--batch: pad or pack.")  # fmt: skip
@click.option("--seq-len", type=click.IntRange(min=1), help="--batch --mode pack: the row "
              "length.  [default: --max-tokens]")  # fmt: skip
@click.option("--packing", type=RegistryChoice(_packings), default="best_fit",
              show_default=True, help="--batch --mode pack: how rows are filled.")  # fmt: skip
@click.option("--epoch", type=click.IntRange(min=0), default=0, show_default=True,
              help="--batch: the epoch.")  # fmt: skip
@click.option("--no-shuffle", is_flag=True, help="--batch: plan without shuffling.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: ids, loss mask, provenance, "
              "runs of trainable tokens with their text.")  # fmt: skip
@translate_errors
def show(
    cache: str,
    indices: tuple[int, ...],
    sample: int | None,
    seed: int,
    source: str | None,
    record: int | None,
    boundaries: bool,
    tokenizer: str | None,
    color: bool | None,
    batch_index: int | None,
    as_json: bool,
    **batch_options: Any,
) -> None:
    """Decode sequences of a CACHE, trainable tokens marked, with where they came from.

    Without a choice, shows the first 3 sequences. A chat cache's tokens with a loss are
    marked in colour on a terminal and between [[ and ]] otherwise (plain text: every token
    has a loss, nothing is marked). Each sequence says its input file, line, record, and, for a
    document cut by --truncation split, the sample ids of all its pieces. Decoding uses the
    tokenizer recorded in the manifest (or --tokenizer); a different one is warned about.

    \b
    Example:
      shardcache show ./cache --sample 5 --seed 1
      shardcache show ./chat-cache --index 42 --tokens
      shardcache show ./cache --source part-00.jsonl --record 7
      shardcache show ./cache --batch 0 --max-tokens 8192 --mode pack --seq-len 2048
    """  # noqa: D301
    from shardcache.store.cache import open_cache
    from shardcache.store.show import (
        RenderOptions,
        batch_json,
        format_batch,
        format_sequence,
        select_samples,
        sequence_json,
    )

    render = RenderOptions(sys.stdout.isatty() if color is None else color, boundaries)
    with open_cache(cache) as opened:
        decode = _decoder(opened, tokenizer)
        if batch_index is not None:
            options = dict(batch_options)
            options["shuffle"] = not options.pop("no_shuffle")
            options["seed"] = seed
            if options["mode"] == "pad":
                del options["seq_len"], options["packing"]
            elif options["seq_len"] is None:
                options["seq_len"] = options["max_tokens"]
            data = batch_json(opened, _show_batch(opened, batch_index, options), decode,
                              boundaries)  # fmt: skip
            text = json.dumps(data, indent=1) if as_json else format_batch(data, decode, render)
            click.echo(text, color=render.color)  # (click strips ANSI off a terminal)
            return
        ids = select_samples(opened, indices, sample, seed, source, record).tolist()
        entries = [sequence_json(opened, i, decode, boundaries) for i in ids]
    if as_json:
        click.echo(json.dumps({"sequences": entries}, indent=1))
    else:
        text = "\n\n".join(format_sequence(e, decode, render) for e in entries)
        click.echo(text, color=render.color)


def _int_list(text: str, param: str, none: str | None = None) -> tuple[Any, ...]:
    """``"0,1,2"`` as ints (``none`` stands for None); BadParameter (exit 2) if not."""
    values: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if none is not None and part == none:
            values.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            value = -1
        if value < 0:
            also = f" or {none!r}" if none else ""
            raise click.BadParameter(
                f"{part!r} in {text!r}: expected integers >= 0{also}, comma-separated, "
                "e.g. 0,1,2,4",
                param_hint=param,
            )
        values.append(value)
    return tuple(values)


@main.command()
@click.argument("cache")
@click.option("--step-ms", type=click.FloatRange(min=0), default=0.0,
              help="The simulated training step per batch, in milliseconds: the model's "
              "forward and backward. Needed for a recommendation.  [default: 0: no step; the "
              "rows time the reader alone and name the fastest]")  # fmt: skip
@click.option("--batches", "-n", type=click.IntRange(min=1), default=50, show_default=True,
              help="Batches per setting, after a first one (reported apart).")  # fmt: skip
@click.option("--workers", "-w", default="0,1,2,4", show_default=True, metavar="N,N,...",
              help="DataLoader worker counts to try.")  # fmt: skip
@click.option("--readahead", default="default", show_default=True, metavar="N,N,...",
              help="Read-ahead shard counts to try (remote caches; 'default': the reader's "
              "default).")  # fmt: skip
@click.option("--depth", default=None, metavar="N,N,...", help="Prefetch depths to try, with "
              "a DevicePrefetcher to --device.  [default: no prefetcher]")  # fmt: skip
@click.option("--device", default=None, help="The device batches are copied to (e.g. cuda); "
              "needed by --depth.")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="The token budget of a batch.")  # fmt: skip
@click.option("--mode", type=RegistryChoice(_plan_modes), default="pad", show_default=True,
              help="pad or pack.")  # fmt: skip
@click.option("--seq-len", type=click.IntRange(min=1), help="--mode pack: the row length.  "
              "[default: --max-tokens]")  # fmt: skip
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="The plan's seed.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the rows and the recommendation "
              "as JSON.")  # fmt: skip
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@translate_errors
def profile(
    cache: str,
    step_ms: float,
    batches: int,
    workers: str,
    readahead: str,
    depth: str | None,
    device: str | None,
    max_tokens: int,
    mode: str,
    seq_len: int | None,
    seed: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Find where a training step waits for a CACHE, over reader settings.

    Runs the real reader (shardcache.loader with a StallMonitor) for each combination of
    --workers, --readahead and --depth, sleeping --step-ms per batch in place of the model,
    and prints per setting the wait share (percent of the step spent waiting for the next
    batch), the wait per batch split into reader and copy waits, the reader's stage times per
    batch (plan, fetch, gather, collate; pin and copy with a prefetcher) and the first batch's
    wait (worker start-up). With --step-ms, recommends the setting with the lowest wait share
    and names its largest stage; without, names the fastest reader and recommends nothing (a
    wait share means something only against a real step). Progress goes to stderr. Exit 2
    on a bad option, 1 when the cache cannot be read.

    \b
    Example:
      shardcache profile ./cache --step-ms 200 --workers 0,1,2,4
      shardcache profile ./cache --mode pack --seq-len 4096 --max-tokens 16384 --json
      shardcache profile s3://bucket/cache --readahead 0,8,32 --depth 2,4 --device cuda
    """  # noqa: D301
    from shardcache.read.profile import ProfileOptions, format_profile, profile_reader

    depths = _int_list(depth, "--depth") if depth is not None else (None,)
    if depth is not None and device is None:
        raise click.BadParameter("a prefetch depth needs --device (e.g. cuda)",
                                 param_hint="--depth")  # fmt: skip
    if mode == "pad" and seq_len is not None:
        raise click.BadParameter("only with --mode pack", param_hint="--seq-len")
    options = ProfileOptions(
        step_ms=step_ms,
        batches=batches,
        workers=_int_list(workers, "--workers"),
        readahead=_int_list(readahead, "--readahead", none="default"),
        depth=depths,
        device=device,
    )
    reader: dict[str, Any] = {"mode": mode, "seed": seed}
    if mode == "pack":
        reader.update(seq_len=seq_len or max_tokens, attention="none")

    def progress(i: int, n: int, setting: dict[str, Any]) -> None:
        if not quiet and not as_json:
            readahead = "default" if setting["readahead"] is None else setting["readahead"]
            depth = "-" if setting["depth"] is None else setting["depth"]
            text = f"workers={setting['workers']}, readahead={readahead}, depth={depth}"
            click.echo(f"profile {i + 1}/{n}: {text}", err=True)

    with interruptible("profile stopped; nothing was written"):
        report = profile_reader(cache, max_tokens, options, reader, progress)
    click.echo(json.dumps(report, indent=1) if as_json else format_profile(report))


def _parse_split(spec: str) -> Any:
    """``--split validation=0.01,test=0.001[,seed=N]`` as a ``Split`` (BadParameter if not)."""
    from shardcache.read.selection.splits import Split

    values: dict[str, Any] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name in values:  # (the last would win silently)
            raise click.BadParameter(
                f"{name!r} is given twice in {spec!r}; give each name once, e.g. "
                "validation=0.05,test=0.01",
                param_hint="--split",
            )
        try:
            if name not in ("validation", "test", "seed", "key"):
                raise ValueError(f"unknown name {name!r}: use validation, test, seed and key")
            values[name] = {"seed": int, "key": str.strip}.get(name, float)(value)
        except ValueError as err:
            raise click.BadParameter(
                f"{part!r}: {err}; write NAME=FRACTION pairs, e.g. validation=0.01,test=0.001",
                param_hint="--split",
            ) from None
    try:
        return Split(**values)
    except ShardcacheError as err:
        raise click.BadParameter(str(err), param_hint="--split") from None


@main.command("export")
@click.argument("cache")
@click.argument("output")
@click.option("--format", "-f", "fmt", required=True, type=RegistryChoice(_export_formats),
              help="megatron: OUTPUT.bin + OUTPUT.idx for megatron-core's IndexedDataset; hf: "
              "a folder for datasets.load_from_disk.")  # fmt: skip
@click.option("--drop-loss-mask", is_flag=True, help="megatron: export a chat cache's ids "
              "without its loss masks (the format cannot hold them).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@translate_errors
def export_command(
    cache: str, output: str, fmt: str, drop_loss_mask: bool, as_json: bool, quiet: bool
) -> None:
    """Export a CACHE to OUTPUT in a format other trainers read.

    Sequences are written in sample-id order, one document each (document i is sample id i:
    `shardcache.open_cache(CACHE).lookup(i)` says where it came from; pieces of a document cut
    by --truncation split are documents of their own). megatron: OUTPUT is a path prefix; the
    tokens are uint16 below a vocabulary of 65500, else int32 (as Megatron's preprocess_data).
    hf: OUTPUT is a folder with an input_ids column (list of int32) and, for a chat cache, a
    loss_mask column (list of int8, 1 where a token has a loss). Streams the cache (bounded
    memory) and renames the output into place at the end: an interrupted export leaves
    nothing under OUTPUT. An existing OUTPUT is refused.

    \b
    Example:
      shardcache export ./cache --format megatron ./megatron/train_text_document
      shardcache export ./chat-cache --format hf ./chat-hf
    """  # noqa: D301
    from tqdm import tqdm

    from shardcache.store.cache import open_cache
    from shardcache.store.export import ExportOptions, export_cache

    options = ExportOptions(fmt, drop_loss_mask=drop_loss_mask)
    with open_cache(cache) as opened:
        bar = tqdm(total=opened.num_tokens, unit="tok", unit_scale=True, desc=f"export {fmt}",
                   disable=quiet or as_json, dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        with bar, interruptible(f"nothing was written under {output!r}; rerun to export"):
            report = export_cache(opened, output, options, bar.update)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        mask = ", loss masks" if report.loss_mask else ""
        click.echo(f"wrote {report.output} ({report.format}): {report.sequences:,} sequences, "
                   f"{report.tokens:,} tokens as {report.dtype}{mask}")  # fmt: skip


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@click.option("--split", "split_spec", default=None, metavar="NAME=FRACTION,...",
              help="Held-out fractions for every source without its own, in place of the "
              "recipe's [splits], e.g. validation=0.01,test=0.001 (seed=N and key=content|path "
              "optional). Path keys read every shard's record column.")  # fmt: skip
@translate_errors
def mix(recipe: str, as_json: bool, split_spec: str | None) -> None:
    """Show what each source of a mixture RECIPE gives an epoch.

    Per source: documents and tokens available, share, tokens per epoch and repetitions (what
    ShardDataset(...).mixture says). Reads the manifests and length indexes only, never a shard.
    With [[schedule]] points: per phase, each source's share, tokens and passes, and the batch
    options of the phase when a point sets any (max_tokens, mode, seq_len, packing).
    A mixture recipe is a TOML file with one [[source]] table (path, weight, max_repetitions,
    name, splits) per cache plus the batch options. With held-out splits (the recipe's [splits]
    or a source's splits, or --split), the table is of the side the recipe reads (split,
    default train), followed by each source's documents, sequences and tokens per side, as
    shardcache info --split counts them; finding the sides reads each cache's content key index
    (path keys: every shard's record column).

    \b
      shardcache mix recipes/mixture.toml
      shardcache mix recipes/mixture.toml --json
      shardcache mix recipes/mixture.toml --split validation=0.01,test=0.001
    """  # noqa: D301
    from shardcache.read.selection.mixed_cache import MixedCache
    from shardcache.read.selection.mixture import source_splits
    from shardcache.read.selection.mixture_recipe import load_mixture_recipe
    from shardcache.read.selection.splits import (
        format_split_summary,
        split_ids,
        split_keys,
        split_summary,
    )

    loaded = load_mixture_recipe(recipe)
    options = loaded.dataset_options()
    splits = _parse_split(split_spec) if split_spec is not None else options.get("splits")
    side = options.get("split", "train" if splits is not None else None)
    per_source = source_splits(loaded.sources, side, splits)
    mixed = MixedCache(loaded.sources)
    try:
        if per_source is None:
            table = mixed.table(loaded.tokens_per_epoch)
            if loaded.schedule is not None:
                click.echo(_schedule_text(loaded, table, as_json, {}))
                return
            click.echo(json.dumps(table.to_json(), indent=1) if as_json else table.format())
            return
        assert side is not None
        keys = [split_keys(c, own) for c, own in zip(mixed.caches, per_source)]
        caches = mixed.caches
        rows = tuple(split_ids(c, own, side, k) for c, own, k in zip(caches, per_source, keys))
        summaries = {
            s.label: split_summary(c, own, k)
            for s, c, own, k in zip(loaded.sources, mixed.caches, per_source, keys)
        }
        table = mixed.table(loaded.tokens_per_epoch, rows, side)
    finally:
        mixed.close()
    if loaded.schedule is not None:
        click.echo(_schedule_text(loaded, table, as_json, {"split": side, "splits": summaries}))
        return
    if as_json:
        click.echo(json.dumps({**table.to_json(), "split": side, "splits": summaries}, indent=1))
        return
    lines = [table.format(), f"(the {side} side of every source's split)"]
    for name, summary in summaries.items():
        fractions = ", ".join(f"{k}={v}" for k, v in summary["split"].items() if k != "key")
        lines += [f"source {name} ({fractions}):", *format_split_summary(summary, "  ")]
    click.echo("\n".join(lines))


def _schedule_text(loaded: Any, table: Any, as_json: bool, extra: dict[str, Any]) -> str:
    """``mix`` of a scheduled recipe: the sources, then per phase each one's share and passes."""
    from shardcache.read.plan.epoch_plan import PlanOptions
    from shardcache.read.plan.planner import batch_options
    from shardcache.read.selection.schedule import resolve_schedule

    layout = resolve_schedule(loaded.schedule, loaded.sources, [r.tokens for r in table.sources])
    base = None  # the recipe's batch options, when a phase sets its own (shown per phase)
    if loaded.schedule.sets_options:
        given = loaded.dataset_options()
        plan = {k: v for k, v in given.items() if k in PlanOptions.__dataclass_fields__}
        budget, shuffle = plan.pop("max_tokens", None), plan.pop("shuffle", None)
        base = batch_options(None, budget, shuffle, plan, None)
    schedule = layout.table(base)
    sources = [
        {k: r.to_json()[k] for k in ("name", "path", "documents", "tokens", "max_repetitions")}
        for r in table.sources
    ]
    if as_json:
        return json.dumps({"sources": sources, "schedule": schedule.to_json(), **extra}, indent=1)
    head = ("source", "documents", "tokens", "max")
    cells = [
        (r["name"], f"{r['documents']:,}", f"{r['tokens']:,}", f"{r['max_repetitions']:g}")
        for r in sources
    ]
    widths = [max(len(c[k]) for c in (head, *cells)) for k in range(4)]
    lines = [
        "  ".join(x.ljust(w) if k == 0 else x.rjust(w) for k, (x, w) in enumerate(zip(c, widths)))
        for c in (head, *cells)
    ]
    lines.append(schedule.format())
    if "split" in extra:
        lines.append(f"(the {extra['split']} side of every source's split)")
    return "\n".join(lines)


def _split_targets(targets: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``check`` takes a CACHE folder and/or a RECIPE file, in either order."""
    cache = recipe = None
    for target in targets:
        if "://" in target or os.path.isdir(target):  # a folder or a URL (object storage)
            if cache is not None:
                raise ConfigError(f"check: two caches given ({cache!r}, {target!r}); give one")
            cache = target
        elif os.path.isfile(target):
            if recipe is not None:
                raise ConfigError(f"check: two recipes given ({recipe!r}, {target!r}); give one")
            recipe = target
        else:
            raise ConfigError(f"check: {target!r} is neither a cache folder nor a recipe file")
    return cache, recipe


def _compare_for_check(
    targets: tuple[str, ...], lock_path: str | None, inputs: tuple[str, ...], flags: dict
) -> tuple[str, Any, Any]:
    """Pick the two keys to compare: (description, old = recorded, new = current)."""
    from shardcache.builder.key_computation import DataHashing, current_key
    from shardcache.store.check import cache_key
    from shardcache.store.key import read_lock

    cache, recipe = _split_targets(targets)
    configured = recipe is not None or flags.get("tokenizer") is not None
    if cache is not None and lock_path is not None and not configured:
        return f"cache {cache} vs. lock {lock_path}", read_lock(lock_path), cache_key(cache)
    if not configured or (cache is None) == (lock_path is None):
        raise ConfigError(
            "check: give CACHE and a RECIPE (or --tokenizer ...), or --lock LOCK and a RECIPE, "
            "or CACHE and --lock LOCK"
        )
    old = read_lock(lock_path) if lock_path is not None else cache_key(str(cache))
    hashing = DataHashing()
    new = current_key(_values(recipe, inputs, flags), hashing)
    if hashing.files:
        click.echo(
            f"hashed {hashing.files} input files, {hashing.bytes / 1e6:.1f} MB in "
            f"{hashing.seconds:.2f} s ({hashing.mb_per_second:.0f} MB/s)",
            err=True,
        )
    recorded = f"lock {lock_path}" if lock_path is not None else f"cache {cache}"
    return f"{recorded} vs. configuration", old, new


@main.command()
@click.argument("targets", nargs=-1, metavar="[CACHE] [RECIPE]")
@click.option("--lock", "lock_path", type=click.Path(dir_okay=False),
              help="A lock file (from `shardcache lock`) to check instead of a cache, or to "
              "check a CACHE against.")  # fmt: skip
@key_options
@click.option("--strict", is_flag=True, help="Any difference is a mismatch, library versions "
              "included (by default a version change alone is a warning when the tokenizer's "
              "output is unchanged).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report.")
def check(targets: tuple[str, ...], lock_path: str | None, inputs: tuple[str, ...],
          strict: bool, as_json: bool, **flags: Any) -> None:  # fmt: skip
    """Tell whether a CACHE or a lock file still matches a configuration.

    \b
      shardcache check CACHE RECIPE          cache vs. recipe/flags (data too if inputs given)
      shardcache check --lock LOCK RECIPE    lock file vs. recipe/flags (the fast CI check)
      shardcache check CACHE --lock LOCK     cache vs. lock file (no tokenizer needed)

    The recorded side (cache or lock) is shown as old, the configuration as new. The data
    part is compared only when inputs (--input or the recipe's) or --data-version are given.
    The tokenizer is resolved from its files (never from the memo a build keeps). Exit codes:
    0 compatible, 1 not compatible, 2 usage or I/O error.
    """  # noqa: D301
    from shardcache.store.check import compare_keys

    try:
        what, old, new = _compare_for_check(targets, lock_path, inputs, flags)
        comparison = compare_keys(old, new, strict)
    except ConfigError as err:
        raise click.UsageError(str(err)) from err
    except ShardcacheError as err:  # unreadable cache, lock, tokenizer or inputs: exit 2
        click.echo(f"Error: {err}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"what": what, **comparison.to_json()}, indent=1, default=str))
    else:
        verdict = "compatible" if comparison.compatible else "NOT compatible"
        current = comparison.compared_digest  # the skipped components are not a difference
        keys = old.digest[:12] if current == old.digest else f"{old.digest[:12]} -> {current[:12]}"
        skipped = [n for n, s in comparison.status.items() if s == "skipped"]
        if skipped:
            keys += f"; {', '.join(skipped)} not compared"
        click.echo(f"{what}: {verdict} (key {keys})")
        details = comparison.describe()
        if details:
            click.echo(details)
    sys.exit(0 if comparison.compatible else 1)


@main.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False))
@key_options
@click.option("--output", "-o", "lock_path", default="shardcache.lock", show_default=True,
              type=click.Path(dir_okay=False), help="Lock file to write.")  # fmt: skip
@click.option("--no-data", is_flag=True, help="Leave the data out of the lock (check then "
              "compares only tokenizer, template and truncation).")  # fmt: skip
@translate_errors
def lock(recipe: str | None, inputs: tuple[str, ...], lock_path: str, no_data: bool,
         **flags: Any) -> None:  # fmt: skip
    """Write the cache key of a configuration to a lock file, without building.

    The data part comes from hashing the inputs (or from --data-version). Commit the lock
    file; CI then runs `shardcache check --lock shardcache.lock RECIPE`.
    """
    from shardcache.builder.key_computation import DataHashing, current_key
    from shardcache.store.key import write_lock

    values = _values(recipe, inputs, flags)
    if no_data:
        values.pop("input", None)
        values.pop("data_version", None)
    elif not values.get("input") and values.get("data_version") is None:
        raise ConfigError("lock: no data given; pass --input, --data-version or --no-data")
    hashing = DataHashing()
    key = current_key(values, hashing)
    write_lock(lock_path, key)
    hashed = f", {hashing.files} input files hashed at {hashing.mb_per_second:.0f} MB/s"
    click.echo(f"wrote {lock_path} (key {key.digest[:12]}{hashed if hashing.files else ''})")


@main.command()
@click.argument("cache")
@click.option(
    "--tokens",
    is_flag=True,
    help="Also re-tokenize a sample of the stored documents from their inputs with the "
    "Hugging Face tokenizer and compare ids (and the loss masks of chat and preference "
    "caches) with the cache.",
)
@click.option(
    "--fraction",
    default="1/64",
    show_default=True,
    help="With --tokens: share of each input's records to re-tokenize (chosen by a fixed "
    "hash of the input's name and the record index), e.g. 0.1, 1/64 or 1 for all.",
)
@click.option("--input", "-i", "inputs", multiple=True, help="With --tokens: the inputs, "
              "when they moved since the build (default: the paths in the manifest).")  # fmt: skip
@click.option("--tokenizer", "-t", help="With --tokens: the tokenizer folder, when it moved "
              "since the build.")  # fmt: skip
@click.option("--workers", "-w", type=click.IntRange(min=1), default=None,
              help="With --tokens: processes that re-tokenize (1: in this process). Never "
              "changes the outcome.  [default: the machine's cores]")  # fmt: skip
@click.option("--quiet", "-q", is_flag=True, help="With --tokens: no progress bar (there is "
              "none when stderr is not a terminal).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@translate_errors
def verify(
    cache: str,
    tokens: bool,
    fraction: str,
    inputs: tuple[str, ...],
    tokenizer: str | None,
    workers: int | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Recompute every checksum of a CACHE and check its structure.

    Checks every shard (size, sha256, Arrow structure, rows, offsets, token type, lengths
    inside the bucket ranges, token ids), the length index, the quarantine file and the
    manifest totals, naming each corrupt or missing file. With --tokens, also re-tokenizes a
    deterministic sample of the documents from their inputs with the Hugging Face tokenizer and
    compares the stored ids (whichever encoder built the cache). Exit 0 when clean, 1 otherwise.

    \b
    Example:
      shardcache verify ./cache
      shardcache verify ./cache --json
      shardcache verify ./cache --tokens --fraction 0.01
      shardcache verify ./cache --tokens --fraction 1      # every document
    """  # noqa: D301
    from shardcache.config import default_workers, parse_fraction
    from shardcache.store.verify import format_verify, verify_cache

    share = parse_fraction(fraction, "fraction")
    if not 0 < share <= 1:
        raise click.BadParameter(f"got {fraction!r}, expected a number in (0, 1]",
                                 param_hint="--fraction")  # fmt: skip
    report = verify_cache(cache)
    audit = None
    if tokens:
        from shardcache.builder.token_audit import audit_tokens, format_token_audit

        progress = _BarProgress(not quiet and not as_json and sys.stderr.isatty(), "verify")
        try:
            audit = audit_tokens(cache, share, inputs or None, tokenizer,
                                 workers or default_workers(), progress)  # fmt: skip
        finally:
            progress.close()
    if as_json:
        data = report.to_json()
        if audit is not None:
            data["tokens"] = audit.to_json()
        click.echo(json.dumps(data, indent=1))
    else:
        click.echo(format_verify(report))
        if audit is not None:
            click.echo(format_token_audit(audit))
    if not report.ok or (audit is not None and not audit.ok):
        sys.exit(1)


def _rewind_decoder(rewinder: Any, tokenizer: str | None) -> Callable[[Any], str] | None:
    """The decoder of the run's first source (or --tokenizer); None (ids shown) if it has none."""
    from shardcache.errors import TokenizerError

    try:
        return _decoder(rewinder.cache(0), tokenizer)
    except TokenizerError as err:
        if tokenizer:
            raise
        click.echo(f"warning: {err}; showing token ids", err=True)
        return None


def _format_rewound(data: dict[str, Any], decode: Any, render: Any) -> str:
    """The text of one rewound batch: where it is, then its rows as ``show --batch`` has them."""
    import numpy as np

    from shardcache.store.show import render_tokens

    rows, width = data["shape"]
    lines = [
        f"step {data['step']} rank {data['rank']} micro {data['micro']}: epoch {data['epoch']} "
        f"global batch {data['global_batch']}, {rows} rows x {width} tokens, "
        f"{data['num_tokens']} tokens"
    ]
    for seg in data["rows"]:
        span = f"[{seg['start']}:{seg['end']}]"
        if seg["sample_id"] is None:
            lines.append(f"  row {seg['row']} {span} <padding x {seg['end'] - seg['start']}>")
            continue
        side = f" {seg['split']} side," if seg["split"] else ""
        transform = ""
        if seg["transform"]:
            done = "changed it" if seg["transformed"] else "left it as stored"
            transform = f" {'+'.join(seg['transform'])} {done},"
        offset = f" from token {seg['offset']}" if seg["offset"] else ""
        lines.append(
            f"  row {seg['row']} {span} #{seg['sample_id']} source {seg['source']}: "
            f"{seg['file']} record {seg['record']} piece {seg['piece']}{offset},{side}"
            f"{transform} {seg['trainable']} with a label"
        )
        if "ids" not in seg:
            continue
        if decode is None:
            lines.append(f"    ids {seg['ids']}")
            continue
        trained = np.asarray(seg["labels"]) != -100
        text = render_tokens(np.asarray(seg["ids"]), trained, decode, render)
        lines.append("    " + text.replace("\n", "\n    "))
    return "\n".join(lines)


@main.command()
@click.argument("run")
@click.option("--step", type=click.IntRange(min=0), help="The optimizer step to recompute "
              "(as the trainer counted it).")  # fmt: skip
@click.option("--rank", type=click.IntRange(min=0), help="--step: only this rank's batches.  "
              "[default: every rank]")  # fmt: skip
@click.option("--micro", type=click.IntRange(min=0), help="--step: only this micro-batch of "
              "the step (gradient accumulation).  [default: all]")  # fmt: skip
@click.option("--steps", "step_range", metavar="FIRST:END", help="Steps FIRST..END-1: write "
              "every batch's sample ids and provenance to --out (JSON lines).")  # fmt: skip
@click.option("--document", metavar="FILE:RECORD", help="The steps at which this document "
              "(input file relative to the build's input root, 0-based record) is "
              "read.")  # fmt: skip
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True,
              help="--document: how many epochs to search, from --step's (or the run's last "
              "segment's) epoch.")  # fmt: skip
@click.option("--skip", "skip_range", metavar="FIRST:END", help="With --state and --out: write "
              "a state that continues as if steps FIRST..END-1 had been read.")  # fmt: skip
@click.option("--exclude", "exclude_list", metavar="FILE:RECORD[,..]", help="With --state and "
              "--out: write a state that leaves these documents out from its position on "
              "(the batches before it unchanged).")  # fmt: skip
@click.option("--exclude-file", type=click.Path(dir_okay=False), help="As "
              "--exclude, the documents listed in a file (one FILE:RECORD a line, # "
              "comments).")  # fmt: skip
@click.option("--state", "state_path", type=click.Path(dir_okay=False), help="--skip, "
              "--exclude: the reader state (JSON) to resume from.")  # fmt: skip
@click.option("--world-size", type=click.IntRange(min=1), help="--skip, --exclude: the "
              "resumed run's world size.  [default: the state's]")  # fmt: skip
@click.option("--grad-accum", type=click.IntRange(min=1), help="--skip, --exclude: the "
              "resumed run's gradient accumulation.  [default: the state's]")  # fmt: skip
@click.option("--out", type=click.Path(dir_okay=False), help="The file --steps, --skip or "
              "--exclude writes.")  # fmt: skip
@click.option("--tokenizer", "-t", help="Tokenizer folder to decode with.  [default: the "
              "build's, as recorded in the manifest]")  # fmt: skip
@click.option("--color/--no-color", default=None, help="Mark trainable tokens in colour "
              "instead of [[ ]].  [default: colour on a terminal]")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON: per batch its place, rows "
              "with provenance, ids and labels.")  # fmt: skip
@translate_errors
def rewind(
    run: str,
    step: int | None,
    rank: int | None,
    micro: int | None,
    step_range: str | None,
    document: str | None,
    epochs: int,
    skip_range: str | None,
    exclude_list: str | None,
    exclude_file: str | None,
    state_path: str | None,
    world_size: int | None,
    grad_accum: int | None,
    out: str | None,
    tokenizer: str | None,
    color: bool | None,
    as_json: bool,
) -> None:
    """Recompute a training step's exact batches from a RUN record; find, skip or leave out data.

    RUN is the run record (write_run_record's file, or a checkpoint folder holding
    shardcache-run.json) or a saved reader state. Only the shards the asked batches use are
    read. Exactly one of --step, --steps, --document, --skip or --exclude (--exclude-file).

    \b
    Example:
      shardcache rewind ckpt/ --step 340000 --rank 3
      shardcache rewind ckpt/ --steps 339900:340100 --out spike.jsonl
      shardcache rewind ckpt/ --document part-07.jsonl:1234 --epochs 2
      shardcache rewind ckpt/ --skip 339900:340300 --state ckpt/reader.json --out skip.json
      shardcache rewind ckpt/ --exclude part-07.jsonl:1234 --state ckpt/reader.json \\
          --out excluded.json
    """  # noqa: D301
    from shardcache.read.exclusion import parse_documents, read_documents
    from shardcache.read.rewind import Rewinder, exclude_state, skip_state
    from shardcache.read.run_record import parse_steps
    from shardcache.store.files import write_json_atomic
    from shardcache.store.show import RenderOptions

    excluding = exclude_list is not None or exclude_file is not None
    given = {"--step": step if document is None else None, "--steps": step_range,
             "--document": document, "--skip": skip_range,
             "--exclude": True if excluding else None}  # fmt: skip
    chosen = [name for name, value in given.items() if value is not None]
    if len(chosen) != 1:
        raise click.UsageError(
            "give exactly one of --step, --steps, --document, --skip, --exclude (or "
            f"--exclude-file) (got {chosen or 'none'})"
        )
    if (step_range or skip_range or excluding) and not out:
        raise click.BadParameter(f"{chosen[0]} writes a file: give --out FILE",
                                 param_hint="--out")  # fmt: skip
    if skip_range is not None or excluding:
        if not state_path:
            raise click.BadParameter(f"{chosen[0]} needs the state to resume from",
                                     param_hint="--state")  # fmt: skip
        try:
            with open(state_path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError) as err:
            raise click.ClickException(
                f"--state {state_path}: cannot read it as JSON ({err})"
            ) from err
        assert out is not None
        if excluding:
            listed = [d for d in (exclude_list or "").split(",") if d.strip()]
            documents = parse_documents(listed)  # (ConfigError: exit 2, as a bad option)
            if exclude_file is not None:
                documents += read_documents(exclude_file)
            if not documents:
                raise click.BadParameter("no document given", param_hint="--exclude")
            new = exclude_state(state, documents, world_size=world_size, grad_accum=grad_accum)
            write_json_atomic(out, new)
            added = new["run"]["exclusions"]
            names = {f"{d['file']}:{d['record']}" for e in added for d in e["documents"]}
            where = max((e["epoch"], e["consumed"]) for e in added)
            click.echo(
                f"wrote {out}: {len(names)} documents left out, the last exclusion from global "
                f"batch {where[1]} of epoch {where[0]} on; the resumed run passes every one "
                "of them to load_state_dict(state, exclude=...) (shardcache.read.exclusion."
                "recorded_documents(state) lists them)"
            )
            return
        assert skip_range is not None  # (chosen: --skip)
        new = skip_state(state, [parse_steps(skip_range, "--skip")], world_size=world_size,
                         grad_accum=grad_accum)  # fmt: skip
        write_json_atomic(out, new)
        skipped = new["run"]["skipped"][-1]
        click.echo(
            f"wrote {out}: from step {skipped['at_step']} the run reads step {skipped['end']}'s "
            f"batches (cursor {skipped['to_consumed']} of epoch {skipped['to_epoch']})"
        )
        return
    with Rewinder(run) as rewinder:
        if document is not None:
            file, sep, number = document.rpartition(":")
            if not sep or not number.isdigit():
                raise click.BadParameter(f"got {document!r}, expected FILE:RECORD",
                                         param_hint="--document")  # fmt: skip
            found = rewinder.find_document(file, int(number), from_step=step, epochs=epochs)
            if as_json:
                click.echo(json.dumps({"document": document, "reads": found}, indent=1))
                return
            click.echo(f"{document}: read {len(found)} times in {epochs} epoch(s)")
            for read in found:
                click.echo(
                    f"  step {read['step']} rank {read['rank']} micro {read['micro']}: epoch "
                    f"{read['epoch']} global batch {read['global_batch']}, source "
                    f"{read['source']} #{read['sample_id']}"
                )
            return
        if step_range is not None:
            first, end = parse_steps(step_range, "--steps")
            assert out is not None
            count = 0
            with open(out, "w", encoding="utf-8") as f:
                for rewound in rewinder.steps(first, end):
                    f.write(json.dumps(rewinder.to_json(rewound, tokens=False)) + "\n")
                    count += 1
            click.echo(f"wrote {out}: {count} batches of steps {first}..{end - 1}")
            return
        assert step is not None
        batches = [rewinder.to_json(r) for r in rewinder.step(step, rank, micro)]
        if as_json:
            click.echo(json.dumps({"batches": batches}, indent=1))
            return
        render = RenderOptions(sys.stdout.isatty() if color is None else color, False)
        decode = _rewind_decoder(rewinder, tokenizer)
        text = "\n\n".join(_format_rewound(b, decode, render) for b in batches)
        click.echo(text, color=render.color)


if __name__ == "__main__":  # pragma: no cover
    main()
