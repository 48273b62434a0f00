"""Rewind against a real ``torchrun --nproc_per_node 2`` run that logged every step's batches.

tests/rewind_ranks.py trains 200 optimizer steps (gradient accumulation 2, DataLoader workers 2,
a mixture with a held-out split and FIM) and logs each micro-batch; the run record it wrote
must give every one of them back: steps, sample ids, masks and transformed tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import assert_batches_equal
from shardcache import Rewinder, read_run_record

pytestmark = pytest.mark.slow  # two ranks with two workers each over ~10 epochs (~30 s)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX = os.path.join(ROOT, "tests", "read", "data", "matrix")
STEPS, WORLD, GRAD_ACCUM = 200, 2, 2


def test_rewind_reproduces_every_step_of_a_torchrun_run(tmp_path):
    root = tmp_path / "caches"
    for name in ("text_a", "text_b"):
        shutil.copytree(os.path.join(MATRIX, name), root / name)
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(WORLD), os.path.join(ROOT, "tests", "rewind_ranks.py"),
               str(root), str(out), str(STEPS)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    record = read_run_record(out)
    assert (record.world_size, record.grad_accum) == (WORLD, GRAD_ACCUM)
    epochs = sorted(record.epoch_batches)
    assert len(epochs) > 2  # (the steps cross epoch boundaries)
    assert sorted(record.epoch_rounds) == epochs  # (each step found by planning one stream)
    logs = {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)}
    assert all(len(log) == STEPS * GRAD_ACCUM for log in logs.values())
    seen = 0
    with Rewinder(out) as rewinder:
        for step in range(STEPS):
            got = rewinder.step(step)
            assert [(r.rank, r.micro) for r in got] == [
                (rank, micro) for rank in range(WORLD) for micro in range(GRAD_ACCUM)
            ]
            for rewound in got:
                want = logs[rewound.rank][(step, rewound.micro)]
                # ids, masks (attention and labels) and FIM's transformed tokens, with meta
                assert_batches_equal(rewound.batch, want)
                seen += 1
    assert seen == STEPS * WORLD * GRAD_ACCUM
