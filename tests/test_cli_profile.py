"""``shardcache profile``: the real reader against a simulated step, one row per setting."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shardcache.cli import main
from shardcache.read.profile import STAGES, ProfileOptions, format_profile, profile_reader


@pytest.fixture()
def small_cache(corpus, tokenizer_dir, build_cache):
    folder, _ = corpus("jsonl", n_files=1, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=32, buckets="8,16,32")


def _profile(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["profile", *args])
    return result.exit_code, result.output


def test_table_has_one_row_per_setting_and_a_recommendation(small_cache):
    code, out = _profile(small_cache, "--workers", "0,1", "--batches", "3", "--max-tokens",
                         "64", "--step-ms", "1")  # fmt: skip
    assert code == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("workers"))
    rows = [line.split() for line in lines[head + 1 :] if line.strip()][:-1]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all(0.0 <= float(row[3]) <= 100.0 for row in rows)
    assert "recommended: workers=" in lines[-1]
    assert "profile 1/2: workers=0" in out and "profile 2/2: workers=1" in out  # progress


def test_json_parses_with_shares_in_range(small_cache):
    code, out = _profile(small_cache, "--workers", "0", "--readahead", "default,0",
                         "--batches", "3", "--max-tokens", "64", "--json")  # fmt: skip
    assert code == 0, out
    report = json.loads(out)
    rows = report["rows"]
    assert [(r["workers"], r["readahead"], r["depth"]) for r in rows] == [
        (0, None, None),
        (0, 0, None),
    ]
    for row in rows:
        assert 0.0 <= row["wait_pct"] <= 100.0
        assert row["batches"] == 3
        assert all(row[s[:-2] + "_ms"] >= 0 for s in STAGES)
    assert report["dominant"] in {s[:-2] for s in STAGES}


def test_pack_mode_runs(small_cache):
    code, out = _profile(small_cache, "--workers", "0", "--batches", "2", "--max-tokens",
                         "64", "--mode", "pack", "--seq-len", "32", "--json")  # fmt: skip
    assert code == 0, out
    assert len(json.loads(out)["rows"]) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--workers", "0,x"],
        ["--workers", "-1"],
        ["--readahead", "soon"],
        ["--depth", "2"],  # a depth needs --device
        ["--step-ms", "-5"],
        ["--batches", "0"],
        ["--seq-len", "32"],  # pad mode
        ["--mode", "squash"],
        ["--step-ms", "inf"],  # was an OverflowError from time.sleep
        ["--step-ms", "nan"],
        # batch arrays of 15 GiB: refused before any is allocated (was an OOM kill)
        ["--mode", "pack", "--seq-len", "999999999", "--max-tokens", "999999999"],
    ],
)
def test_a_bad_option_exits_2_without_a_traceback(small_cache, args):
    result = CliRunner().invoke(main, ["profile", small_cache, *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_missing_cache_exits_1(tmp_path):
    code, out = _profile(str(tmp_path / "nothing"), "--workers", "0", "--batches", "1")
    assert code == 1, out
    assert "Traceback" not in out


def test_a_long_step_lowers_the_wait_share(small_cache):
    def share(step_ms: float) -> float:
        options = ProfileOptions(step_ms=step_ms, batches=4, workers=(0,))
        return profile_reader(small_cache, 64, options)["rows"][0]["wait_pct"]

    assert share(50.0) < share(0.0)


def test_the_recommendation_is_the_row_with_the_lowest_wait(small_cache, monkeypatch):
    import shardcache.read.profile as profile

    shares = iter([40.0, 5.0, 20.0])
    real = profile._run_setting

    def fake(batches, options):
        return {**real(batches, options), "wait_pct": next(shares)}

    monkeypatch.setattr(profile, "_run_setting", fake)
    options = ProfileOptions(step_ms=1.0, batches=1, workers=(0,), readahead=(None, 0, 1))
    report = profile_reader(small_cache, 64, options)
    assert [r["wait_pct"] for r in report["rows"]] == [40.0, 5.0, 20.0]
    assert report["recommended"] == 1
    assert "recommended: workers=0 readahead=0 depth=-" in format_profile(report)


def test_without_a_step_nothing_is_recommended_and_the_fastest_is_named(small_cache, monkeypatch):
    # before: with no --step-ms the loop was the reader alone (a ~2 ms "step"), and the setting
    # with the lowest of those ~100% wait shares was recommended as if it were a training step's
    import shardcache.read.profile as profile

    code, out = _profile(small_cache, "--workers", "0", "--batches", "2", "--max-tokens", "64")
    assert code == 0, out
    assert out.splitlines()[-1].startswith("no recommendation: no --step-ms was given")
    waits = iter([3.0, 1.0, 2.0])
    real = profile._run_setting

    def fake(batches, options):
        return {**real(batches, options), "wait_pct": 99.0, "wait_ms": next(waits)}

    monkeypatch.setattr(profile, "_run_setting", fake)
    options = ProfileOptions(batches=1, workers=(0,), readahead=(None, 0, 1))
    report = profile_reader(small_cache, 64, options)
    assert report["recommended"] is None and report["fastest"] == 1
    text = format_profile(report).splitlines()[-1]
    assert text.startswith("no recommendation: no --step-ms was given")
    assert "fastest reader here is workers=0 readahead=0 depth=- (1.00 ms a batch" in text
    assert "recommended:" not in text


def test_options_are_validated():
    from shardcache.errors import ConfigError

    with pytest.raises(ConfigError, match="depth"):
        ProfileOptions(depth=(2,))
    with pytest.raises(ConfigError, match="workers"):
        ProfileOptions(workers=())


def test_a_step_or_a_batch_past_what_can_run_is_refused_naming_it():
    from shardcache import PlanOptions
    from shardcache.errors import ConfigError

    with pytest.raises(ConfigError, match=r"step_ms: got inf, .*from 0 to 3,600,000"):
        ProfileOptions(step_ms=float("inf"))
    with pytest.raises(ConfigError, match=r"max_tokens: got 999,999,999, .*14\.9 GiB"):
        PlanOptions(max_tokens=999_999_999, mode="pack", seq_len=999_999_999)
    assert PlanOptions(max_tokens=1 << 27).max_tokens == 1 << 27  # the bound itself is allowed
