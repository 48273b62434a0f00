"""``shardcache mix RECIPE``: the mixture table from manifests and length indexes, the same
as ``ShardDataset(...).mixture``, and each source's held-out sides; the mixture recipe and its
training loop."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
from click.testing import CliRunner

from conftest import make_texts, write_records
from shardcache import ShardDataset, Split, open_cache
from shardcache.cli import main
from shardcache.read.selection.mixture_recipe import load_mixture_recipe
from shardcache.read.selection.splits import split_ids, split_summary

#: An eval pass over these weighted sources on purpose: the warning that the weights do not
#: apply is tested in tests/read/test_construction_checks.py.
UNWEIGHTED_EVAL = pytest.mark.filterwarnings("ignore:.*eval=True reads every document:UserWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(root, name: str, tokenizer: str, docs: int, seed: int) -> str:
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = root / f"corpus-{name}"
    folder.mkdir()
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in make_texts(docs, seed)], "jsonl")
    out = str(root / name)
    values = {"input": str(folder), "tokenizer": tokenizer, "output": out, "workers": 1,
              "max_length": 64, "truncation": "split", "buckets": "16,32"}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir) -> str:
    root = tmp_path_factory.mktemp("mix")
    _build(root, "web", tokenizer_dir, 80, 1)
    _build(root, "code", tokenizer_dir, 20, 2)
    return str(root)


RECIPE = """\
seed = 3
max_tokens = 256
mode = "pack"
seq_len = 64
attention = "mask"
{extra}
[[source]]
path = "web"
weight = 0.7

[[source]]
path = "code"
name = "the-code"
weight = 0.3
max_repetitions = 3
"""


def _recipe(caches: str, extra: str = "") -> str:
    path = os.path.join(caches, f"mix-{abs(hash(extra))}.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(RECIPE.format(extra=extra))
    return path


@pytest.mark.parametrize("extra", ["", "tokens_per_epoch = 1500"])
def test_mix_prints_the_table_the_dataset_reports(caches, extra):
    path = _recipe(caches, extra)
    recipe = load_mixture_recipe(path)
    ds = ShardDataset(recipe.sources, **recipe.dataset_options())
    result = CliRunner().invoke(main, ["mix", path, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == ds.mixture.to_json()
    text = CliRunner().invoke(main, ["mix", path])
    assert text.exit_code == 0, text.output
    assert text.output.strip() == ds.mixture.format()
    assert "the-code" in text.output and "tokens per epoch" in text.output


def test_mix_reads_no_shard(caches, monkeypatch):
    from shardcache.store import cache as store_cache

    def refuse(*args, **kwargs):
        raise AssertionError("a shard was opened")

    monkeypatch.setattr(store_cache.ShardCache, "get", refuse)
    result = CliRunner().invoke(main, ["mix", _recipe(caches), "--json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("text", "match"),
    [(RECIPE.format(extra="tokens_per_epoch = 100000000"), "max_repetitions"),
     (RECIPE.replace('"pack"', '"pak"').format(extra=""), "mode"),
     (RECIPE.format(extra="sources = 1"), "unknown key 'sources'"),
     (RECIPE.format(extra="").replace("max_repetitions = 3", "max_repetitions = 0"),
      "max_repetitions")],
    ids=["too-many-tokens", "bad-mode", "unknown-key", "bad-cap"],
)  # fmt: skip
def test_mix_usage_errors_exit_2_and_say_why(caches, text, match):
    path = os.path.join(caches, "bad.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    result = CliRunner().invoke(main, ["mix", path])
    assert result.exit_code == 2, result.output
    assert match in result.output


@pytest.mark.parametrize(
    ("web", "code", "match"),
    [("weight = 1e308", "weight = 1e308", None),
     ("weight = 1e308", "weight = 1e-308", "no token"),
     ("weight = 5e-324", "weight = 1", "no token"),
     ("max_repetitions = 1e308", "", None),
     ("max_repetitions = 1e308", "max_repetitions = 1e308", "max_repetitions")],
    ids=["huge-weights", "weights-apart", "tiny-weight", "huge-cap", "huge-caps"],
)  # fmt: skip
def test_mix_with_extreme_finite_numbers_prints_a_table_or_exits_2(caches, web, code, match):
    path = os.path.join(caches, "extreme.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'max_tokens = 256\n[[source]]\npath = "web"\n{web}\n'
                f'[[source]]\npath = "code"\n{code}\n')  # fmt: skip
    result = CliRunner().invoke(main, ["mix", path])
    if match is None:
        assert result.exit_code == 0, result.output
        assert "tokens per epoch" in result.output
    else:
        assert result.exit_code == 2, result.output
        assert match in result.output


def test_a_recipe_that_is_not_utf8_exits_2_and_says_so(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('max_tokens = 256\n# caf\u00e9\n[[source]]\npath = "web"\n'.encode("latin-1"))
    result = CliRunner().invoke(main, ["mix", str(path)])
    assert result.exit_code == 2, result.output
    assert "UTF-8" in result.output and "Traceback" not in result.output


def test_a_recipe_without_sources_is_refused(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("max_tokens = 256\n")
    result = CliRunner().invoke(main, ["mix", str(path)])
    assert result.exit_code == 2 and "[[source]]" in result.output


def test_the_bundled_mixture_recipe_parses():
    recipe = load_mixture_recipe(os.path.join(ROOT, "recipes", "mixture.toml"))
    assert [s.label for s in recipe.sources] == ["docs", "chat"]
    assert recipe.dataset_options()["attention"] == "mask"


def test_the_mixture_training_loop_runs_resumes_and_delivers_the_shares(caches, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_mixture", os.path.join(ROOT, "recipes", "train_mixture.py")
    )
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    path = _recipe(caches)
    common = [path, "--num-workers", "0", "--log-every", "100"]
    full = train.main([*common, "--steps", "6"])
    assert len(full["losses"]) == 6 and all(x == x for x in full["losses"])
    assert set(full["tokens"]) == {"web", "the-code"} and all(full["tokens"].values())
    state = str(tmp_path / "state.json")
    head = train.main([*common, "--steps", "2", "--save-state", state])
    tail = train.main([*common, "--steps", "4", "--resume", state])
    assert tail["state"] == full["state"]
    assert {k: head["tokens"][k] + tail["tokens"][k] for k in head["tokens"]} == full["tokens"]


SPLITS = "[splits]\nvalidation = 0.2\ntest = 0.1\n"
OWN = "max_repetitions = 3\nsplits = { validation = 0.5, seed = 4 }"  # the code source's own


def _mix_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["mix", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_mix_shows_each_source_s_sides_and_the_table_of_the_side_the_recipe_reads(caches):
    path = _recipe(caches, SPLITS)
    recipe = load_mixture_recipe(path)
    assert recipe.dataset_options()["split"] == "train"  # a training run's side by default
    ds = ShardDataset(recipe.sources, **recipe.dataset_options())
    got = _mix_json(path)
    assert {k: v for k, v in got.items() if k not in ("split", "splits")} == ds.mixture.to_json()
    assert got["split"] == "train" and list(got["splits"]) == ["web", "the-code"]
    for source in recipe.sources:
        with open_cache(source.path) as cache:  # what shardcache info --split counts
            assert got["splits"][source.label] == split_summary(cache, Split(0.2, 0.1))
    text = CliRunner().invoke(main, ["mix", path])
    assert text.exit_code == 0, text.output
    assert ds.mixture.format() in text.output
    assert "source the-code (validation=0.2, test=0.1, seed=0):" in text.output
    assert "  split validation " in text.output
    # the same fractions from --split, for a recipe without [splits]
    assert _mix_json(_recipe(caches), "--split", "validation=0.2,test=0.1") == got


@UNWEIGHTED_EVAL
def test_a_recipe_s_per_source_splits_reach_the_dataset_and_mix(caches):
    path = os.path.join(caches, "own.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(RECIPE.format(extra=SPLITS).replace("max_repetitions = 3", OWN))
    recipe = load_mixture_recipe(path)
    own = Split(validation=0.5, seed=4)
    assert recipe.sources[1].splits == own
    options = recipe.dataset_options(split="validation")
    ds = ShardDataset(recipe.sources, **options, eval=True)
    got = {(int(s), int(i)) for b in ds if not bool(b["meta"]["filler"])
           for s, i in zip(b["meta"]["source_ids"], b["meta"]["sample_ids"]) if s >= 0}  # fmt: skip
    want = set()
    for s, (source, split) in enumerate(zip(recipe.sources, (Split(0.2, 0.1), own))):
        with open_cache(source.path) as cache:
            want |= {(s, int(i)) for i in split_ids(cache, split, "validation")}
    assert got == want
    shown = _mix_json(path)
    assert shown["splits"]["the-code"]["split"] == own.to_json()
    # --split replaces the recipe's [splits], not a source's own
    other = _mix_json(path, "--split", "validation=0.3")
    assert other["splits"]["web"]["split"] == Split(0.3).to_json()
    assert other["splits"]["the-code"]["split"] == own.to_json()


@pytest.mark.parametrize(
    ("extra", "args", "match"),
    [('split = "valid"', [], "expected one of"),
     ('split = "validation"', [], "have no held-out fractions"),
     ("[splits]\nvalidation = 0.2\ntrain = 0.1\n", [], "unknown field(s) ['train']"),
     ("", ["--split", "valid=0.1"], "unknown name 'valid'"),
     ("", ["--split", "validation=0.6,test=0.4"], "sum to less than 1"),
     ("", ["--split", "validation=0.05,validation=0.2"], "'validation' is given twice")],
    ids=["bad-side", "side-without-splits", "bad-field", "bad-option", "no-train",
         "repeated-name"],
)  # fmt: skip
def test_bad_splits_in_a_recipe_or_on_the_command_line_exit_2(caches, extra, args, match):
    result = CliRunner().invoke(main, ["mix", _recipe(caches, extra), *args])
    assert result.exit_code == 2, result.output
    assert match in result.output and "Traceback" not in result.output


SCHEDULE = """\
window_tokens = 250
total_tokens = 1100
[[schedule]]
at_tokens = 0
weights = {web = 0.9, the-code = 0.1}
[[schedule]]
at_tokens = 600
weights = {web = 0.5, the-code = 0.5}
"""


def test_mix_prints_a_recipe_s_schedule_phase_by_phase_as_the_dataset_has_it(caches):
    path = _recipe(caches, SCHEDULE)
    recipe = load_mixture_recipe(path)
    assert recipe.schedule is not None and recipe.schedule.window_tokens == 250
    ds = ShardDataset(recipe.sources, **recipe.dataset_options())
    assert ds.epochs == 5  # 0-250-500-600 | 600-850-1,100
    result = CliRunner().invoke(main, ["mix", path, "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["schedule"] == ds.schedule.to_json()
    phases = shown["schedule"]["phases"]
    assert [(p["start"], p["end"]) for p in phases] == [(0, 600), (600, 1100)]
    assert [s["tokens"] for s in phases[0]["sources"]] == [540, 60]
    assert [s["tokens"] for s in phases[1]["sources"]] == [250, 250]
    text = CliRunner().invoke(main, ["mix", path])
    assert text.exit_code == 0, text.output
    assert "phase 1: tokens 600 .. 1,100 (windows 3 .. 4)" in text.output
    for window in range(ds.epochs):  # the text numbers phases as phase_of does, from 0
        phase = ds.schedule.phase_of(window)
        first, after = ds.schedule.phase_windows[phase]
        assert f"phase {phase}: " in text.output and first <= window < after
    assert f"phase {len(phases)}:" not in text.output
    assert "run: 1,100 tokens in 5 windows" in text.output


@pytest.mark.parametrize(
    "extra, match",
    [
        ("window_tokens = 10\n", "no \\[\\[schedule\\]\\] table"),
        ("[[schedule]]\nat_tokens = 0\nweights = {nope = 1}\n", "'nope'"),
        ("[[schedule]]\nat_tokens = 5\nweights = {web = 1}\n", "start at at_tokens=0"),
        (SCHEDULE.replace("1100", "400000"), "source 'web'.*max_repetitions=1 bounds"),
    ],
)
def test_a_bad_schedule_in_a_recipe_exits_2_and_says_why(caches, extra, match):
    result = CliRunner().invoke(main, ["mix", _recipe(caches, extra)])
    assert result.exit_code == 2, result.output
    assert re.search(match, result.output), result.output


def test_the_bundled_schedule_recipe_parses():
    recipe = load_mixture_recipe(os.path.join(ROOT, "recipes", "mixture_schedule.toml"))
    assert recipe.schedule is not None and len(recipe.schedule.points) == 2
    assert recipe.dataset_options()["schedule"] is recipe.schedule


@pytest.mark.parametrize("at", [10**14, 10**16, 10**18, 2**62])
def test_a_schedule_point_past_a_source_s_cap_is_one_line_exit_2_naming_both(caches, at):
    """A point at 1e14..2**62 tokens (billions of 250-token windows, none cut) needs more of
    web than its max_repetitions allow: one line naming the source and the point."""
    extra = SCHEDULE.replace("total_tokens = 1100\n", "").replace("600", str(at))
    result = CliRunner().invoke(main, ["mix", _recipe(caches, extra)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert re.search(rf"source 'web' .* by token {at:,} \(its last point\).*max_repetitions=1 "
                     "bounds", errors[0])  # fmt: skip


LENGTH_PHASES = SCHEDULE.replace(
    "at_tokens = 600\n", "at_tokens = 600\nseq_len = 128\nmax_tokens = 512\n"
)


def test_mix_shows_each_phase_s_batch_options_as_the_dataset_reads_them(caches):
    path = _recipe(caches, LENGTH_PHASES)
    recipe = load_mixture_recipe(path)
    assert recipe.schedule is not None
    assert recipe.schedule.points[1].options == {"max_tokens": 512, "seq_len": 128}
    ds = ShardDataset(recipe.sources, **recipe.dataset_options())
    result = CliRunner().invoke(main, ["mix", path, "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["schedule"] == ds.schedule.to_json()
    options = [p["options"] for p in shown["schedule"]["phases"]]
    assert options == [
        {"max_tokens": 256, "mode": "pack", "seq_len": 64, "packing": "best_fit"},
        {"max_tokens": 512, "mode": "pack", "seq_len": 128, "packing": "best_fit"},
    ]
    text = CliRunner().invoke(main, ["mix", path])
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    at = lines.index("phase 1: tokens 600 .. 1,100 (windows 3 .. 4)")
    assert lines[at + 1] == "  batches: max_tokens=512, mode=pack, seq_len=128, packing=best_fit"
    assert "  batches: max_tokens=256, mode=pack, seq_len=64, packing=best_fit" in lines
    ds.set_epoch(3)  # the first window of phase 1 reads rows of its seq_len
    assert {b["input_ids"].shape[1] for b in ds} == {128}
    # a schedule without options shows none (the output of before)
    plain = CliRunner().invoke(main, ["mix", _recipe(caches, SCHEDULE), "--json"])
    assert all("options" not in p for p in json.loads(plain.output)["schedule"]["phases"])


@pytest.mark.parametrize(
    "extra, match",
    [
        (SCHEDULE.replace("at_tokens = 600\n", "at_tokens = 600\nseq_len = 1024\n"),
         r"point #2 \(at_tokens=600\).*seq_len: 1024 exceeds max_tokens=256"),
        (SCHEDULE.replace("at_tokens = 600\n", "at_tokens = 600\nseq_lenght = 1\n"),
         r"unknown key\(s\) \['seq_lenght'\]"),
    ],
)  # fmt: skip
def test_bad_phase_options_in_a_recipe_exit_2_naming_the_point(caches, extra, match):
    result = CliRunner().invoke(main, ["mix", _recipe(caches, extra)])
    assert result.exit_code == 2, result.output
    assert re.search(match, result.output), result.output
