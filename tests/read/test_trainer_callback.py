"""StallMonitorCallback: transformers' Trainer logs where each step waited for data, and its
reporters (TensorBoard here) receive the figures when the callback is attached ahead of them."""

from __future__ import annotations

import glob
import time

import pytest

import shardcache
from shardcache import ConfigError, StallMonitorCallback

pytest.importorskip("transformers")
from trainer_ranks import CountingLM  # (the model)

SLOW_S = 0.002  # per sequence, in the (fake slow) gather stage
COMPUTE_S = 0.01  # per step, in the model
KEYS = ("data_loading_pct", "data_loading_s", "step_s", "wait_reader_s", "wait_copy_s",
        "plan_s", "fetch_s", "gather_s", "collate_s")  # fmt: skip


def slow_transform(ids, mask, rng):
    time.sleep(SLOW_S)
    return ids, mask


class SlowLM(CountingLM):
    """CountingLM that takes ``COMPUTE_S`` per forward: a step that computes."""

    def forward(self, *args, **kwargs):
        time.sleep(COMPUTE_S)
        return super().forward(*args, **kwargs)


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="16,32")


def test_trainer_logs_carry_the_monitor_figures_and_reach_tensorboard(
    cache_dir, tmp_path, monkeypatch
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import TrainingArguments

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    shard_loader = shardcache.loader(cache_dir, 128, seed=1, num_workers=0,
                                     transform=slow_transform)  # fmt: skip
    model = SlowLM(int(shardcache.open_cache(cache_dir).manifest["tokenizer"]["vocab_size"]))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=6, logging_steps=2, report_to=["tensorboard"],
        save_strategy="no", use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant",
    )  # fmt: skip
    from shardcache.integrations.hf import ShardTrainer

    trainer = ShardTrainer(  # (SlowLM has no output layer: its own loss, whole logits)
        model=model, args=args, shard_loader=shard_loader, chunk_tokens=0, stall_monitor=False
    )
    callback = StallMonitorCallback().attach(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()

    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4, 6]
    for entry in logged:
        assert set(KEYS) <= set(entry)
        assert "data_loading_max_s" not in entry  # one process: no skew
        assert 0 < entry["data_loading_pct"] < 100
        assert entry["data_loading_pct"] == pytest.approx(
            100 * entry["data_loading_s"] / entry["step_s"]
        )
        assert entry["step_s"] >= COMPUTE_S + entry["data_loading_s"] - 1e-6
        # in-process: the wait is the reader's, and the slow gather is most of it
        assert entry["wait_reader_s"] == entry["data_loading_s"] and entry["wait_copy_s"] == 0
        assert entry["gather_s"] >= 2 * SLOW_S  # a batch holds 2 sequences or more, each slept
        assert entry["gather_s"] > entry["collate_s"]
    assert shard_loader.monitor is None  # handed back at the end of training

    (folder,) = {p.rsplit("/", 1)[0] for p in glob.glob(str(tmp_path / "tb" / "**" / "events.*"),
                                                        recursive=True)}  # fmt: skip
    events = EventAccumulator(folder)
    events.Reload()
    for name in ("data_loading_pct", "wait_reader_s", "gather_s"):
        scalars = events.Scalars(f"train/{name}")  # transformers prefixes "train/"
        assert [s.step for s in scalars] == [2, 4, 6]
        assert [s.value for s in scalars] == pytest.approx([e[name] for e in logged], rel=1e-5)


def test_a_train_dataloader_that_is_not_a_shard_loader_is_refused():
    callback = StallMonitorCallback()
    with pytest.raises(ConfigError, match=r"is a list, not a shardcache\.ShardLoader"):
        callback.on_train_begin(None, None, None, train_dataloader=[{"input_ids": 0}])


def test_events_it_does_not_handle_are_no_ops():
    callback = StallMonitorCallback()
    assert callback.on_prediction_step(None, None, None, model=None) is None
    assert callback.on_some_future_event(None, None, None) is None
    with pytest.raises(AttributeError, match="not_an_event"):
        callback.not_an_event  # noqa: B018
    assert callback.figures() == {}  # no step ended yet


def test_an_evaluation_log_leaves_the_figures_to_the_next_training_log():
    import types

    callback = StallMonitorCallback(ranks=False)
    state = types.SimpleNamespace(global_step=0, log_history=[])
    for step in (1, 2):
        state.global_step = step
        callback.on_step_end(None, state, None)
    evaluation = {"eval_loss": 1.0}
    state.log_history.append({**evaluation, "step": 2})
    callback.on_log(None, state, None, logs=evaluation)
    assert evaluation == {"eval_loss": 1.0} and state.log_history[-1] == {"eval_loss": 1.0,
                                                                           "step": 2}  # fmt: skip
    training = {"loss": 2.0}
    state.log_history.append({**training, "step": 2})
    callback.on_log(None, state, None, logs=training)
    assert set(KEYS) <= set(training) and set(KEYS) <= set(state.log_history[-1])
    assert callback.figures() == {}  # the window was reset by the log
