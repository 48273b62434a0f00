"""A packing policy is one module plus one registry line: once registered, PlanOptions, the
planner and the CLI's --packing offer it with no other edit, and unregistering takes it back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from shardcache.cli import main
from shardcache.errors import ConfigError
from shardcache.read.plan import policies
from shardcache.read.plan.epoch_plan import PlanOptions, plan_epoch
from shardcache.read.plan.plan_arrays import EpochPlan
from shardcache.read.plan.policies.base import pack_order, rows_to_batches

NAME = "one_per_row"


def _one_per_row(lengths, buckets, options, rng) -> EpochPlan:
    """Every sequence alone in its row (a test-only policy)."""
    if int(lengths.max()) > options.seq_len:
        raise ConfigError(f"seq_len: {options.seq_len} is shorter than a sequence")
    ids = pack_order(len(lengths), rng)
    row_offsets = np.arange(len(ids) + 1, dtype=np.int64)
    return EpochPlan(rows_to_batches(row_offsets, options.rows_per_batch), ids, row_offsets)


@pytest.fixture()
def one_per_row():
    policies.register(NAME, _one_per_row)
    try:
        yield NAME
    finally:
        policies.unregister(NAME)


def _packing_choices() -> tuple[str, ...]:
    [param] = [p for p in main.commands["show"].params if p.name == "packing"]
    return tuple(param.type.choices)


def test_the_builtin_policies_are_the_registry():
    assert policies.modes() == ("pad", "pack")
    assert policies.packings() == ("best_fit", "concat")
    assert _packing_choices() == policies.packings()
    with pytest.raises(ConfigError, match=f"packing: got '{NAME}', expected one of best_fit"):
        PlanOptions(max_tokens=64, mode="pack", seq_len=16, packing=NAME)


def test_a_registered_policy_plans_and_is_a_choice(one_per_row):
    options = PlanOptions(max_tokens=64, mode="pack", seq_len=16, packing=one_per_row)
    assert PlanOptions.from_json(json.loads(json.dumps(options.to_json()))) == options
    assert one_per_row in policies.packings()
    assert one_per_row in _packing_choices()
    plan = plan_epoch(np.array([3, 16, 1, 7, 9]), np.zeros(5), options, seed=1)
    assert plan.batch_offsets.tolist() == [0, 4, 5]  # 64 // 16 rows a batch
    assert sorted(plan.sample_ids.tolist()) == [0, 1, 2, 3, 4]
    assert all(len(plan.row_bounds(b)) - 1 == len(plan.batch(b)) for b in range(len(plan)))
    result = CliRunner().invoke(main, ["show", "--help"])
    assert result.exit_code == 0 and one_per_row in result.output


def test_the_cli_plans_a_batch_with_a_registered_policy(one_per_row, corpus, tokenizer_dir,
                                                        build_cache):  # fmt: skip
    folder, _ = corpus("jsonl", n_files=1, docs=20)
    cache = build_cache(folder, tokenizer_dir, max_length=32, buckets="8,16,32")
    args = ["show", cache, "--batch", "0", "--max-tokens", "64", "--mode", "pack", "--seq-len",
            "32", "--json"]  # fmt: skip
    result = CliRunner().invoke(main, [*args, "--packing", one_per_row])
    assert result.exit_code == 0, result.output
    policies.unregister(one_per_row)
    try:
        refused = CliRunner().invoke(main, [*args, "--packing", one_per_row])
    finally:
        policies.register(one_per_row, _one_per_row)
    assert refused.exit_code == 2 and "best_fit" in refused.output


def test_register_refuses_a_taken_name_and_a_second_pad_policy():
    with pytest.raises(ConfigError, match="already registered"):
        policies.register("best_fit", _one_per_row)
    with pytest.raises(ConfigError, match="mode 'pad'"):
        policies.register("pad_again", _one_per_row, mode="pad")
    with pytest.raises(ConfigError, match="mode: got 'rows'"):
        policies.register(NAME, _one_per_row, mode="rows")
    assert NAME not in policies.POLICIES
    with pytest.raises(ConfigError, match="packing policy: got 'nothing'"):
        policies.unregister("nothing")
