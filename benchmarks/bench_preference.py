"""Preference pairs: shardcache build + read against TRL's own tokenization (not part of the tests).

    python benchmarks/bench_preference.py --tokenizer TOKENIZER_DIR [--pairs 100000] [--rounds 3]

The corpus is generated, deterministic (``--seed``): ``--pairs`` string records
``{"prompt", "chosen", "rejected"}`` of random words (prompt 8-60 words, each completion
4-120), written as 4 jsonl files before anything is timed. A tokenizer without an EOS token
(BERT's WordPiece) gets its SEP token as EOS on the TRL side, as TRL needs one.

Measured in one run, the two sides alternating round by round (best of ``--rounds``):

* ``shardcache``: ``shardcache build --preference`` (the CLI, a fresh process: read + parse +
  tokenize prompt and completions + masks + write + commit, default workers), then one read
  pass in another process: ``ShardDataset(cache, --max-tokens)`` pad-mode pair batches, every
  batch's ids summed;
* ``trl``: in a fresh process, ``datasets.load_dataset("json")`` of the same files (its own
  cache folder per round, so nothing is reused) and ``DPOTrainer._prepare_dataset``, the very
  function ``DPOTrainer.__init__`` tokenizes the train set with (add EOS, tokenize prompt,
  prompt + chosen and prompt + rejected, split at the common prefix), with
  ``dataset_num_proc`` = ``--num-proc`` (default: the cores, as many processes as shardcache's
  build uses); then one read pass: a ``DataLoader`` over the tokenized rows with TRL's
  ``DataCollatorForPreference`` (``--trl-batch`` pairs a batch), every batch's ids summed.

Phases: ``read`` is the pass over the batches, timed inside its process (from the dataset's
construction to the last batch); ``build`` is the rest of the work before it: the build
process's wall time for shardcache, the TRL process's wall time less its read for TRL (process
start, imports, JSON load, tokenization). Printed: seconds per phase, pairs/s, and the ratio
TRL / shardcache of the build, of the read and of both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from results import record_result

WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "or has had first one their its new after who they two her she been other when there all "
    "during into school time may years more most only over city some world would where later "
    "up such used many can state about national out known university united then made data "
    "shard cache token batch epoch rank worker stream budget bucket length python tensor model "
    "train loss answer question because however between through while under against without"
).split()


def write_corpus(folder: str, pairs: int, seed: int, files: int = 4) -> int:
    """``pairs`` records over ``files`` jsonl files; returns the bytes written."""
    rng = random.Random(seed)
    size = 0
    per_file = -(-pairs // files)
    for f in range(files):
        lines = []
        for _ in range(min(per_file, pairs - f * per_file)):
            record = {
                "prompt": " ".join(rng.choices(WORDS, k=rng.randint(8, 60))) + "?",
                "chosen": " " + " ".join(rng.choices(WORDS, k=rng.randint(4, 120))) + ".",
                "rejected": " " + " ".join(rng.choices(WORDS, k=rng.randint(4, 120))) + ".",
            }
            lines.append(json.dumps(record))
        data = ("\n".join(lines) + "\n").encode()
        with open(os.path.join(folder, f"pairs-{f:02d}.jsonl"), "wb") as out:
            out.write(data)
        size += len(data)
    return size


READ_OURS = """
import sys, time
import numpy as np
from shardcache import ShardDataset
start = time.perf_counter()
total = batches = pairs = 0
for batch in ShardDataset(sys.argv[1], int(sys.argv[2]), seed=0):
    total += int(batch["input_ids"].sum())
    batches += 1
    pairs += len(batch["input_ids"]) // 2
print(time.perf_counter() - start, batches, pairs, total)
"""

TRL_SIDE = """
import sys, time
start = time.perf_counter()
import torch
from datasets import load_dataset
from transformers import AutoTokenizer
from trl import DPOConfig
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
corpus, tokenizer_dir, cache_dir, num_proc, batch_size = sys.argv[1:6]
tok = AutoTokenizer.from_pretrained(tokenizer_dir)
if tok.eos_token is None:
    tok.eos_token = tok.sep_token
files = sorted(__import__("glob").glob(corpus + "/*.jsonl"))
dataset = load_dataset("json", data_files=files, split="train", cache_dir=cache_dir)
args = DPOConfig(output_dir=cache_dir + "/out", dataset_num_proc=int(num_proc) or None,
                 report_to="none", activation_checkpointing=False, use_cpu=True, bf16=False)
class Holder:  # what _prepare_dataset reads of the trainer
    _tokenizer = tok
prepared = DPOTrainer._prepare_dataset(Holder(), dataset, tok, args, "train")
built = time.perf_counter() - start
start = time.perf_counter()
collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
loader = torch.utils.data.DataLoader(prepared.with_format(None), batch_size=int(batch_size),
                                     shuffle=True, collate_fn=collate)
total = batches = 0
for batch in loader:
    total += int(batch["input_ids"].sum())
    batches += 1
print(built, time.perf_counter() - start, batches, len(prepared), total)
"""


def build_command(corpus: str, tokenizer: str, output: str) -> list[str]:
    """``shardcache build --preference`` of the corpus, as a user runs it."""
    return [sys.executable, "-m", "shardcache", "build", "--input", corpus, "--tokenizer",
            tokenizer, "--preference", "-o", output, "-q"]  # fmt: skip


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return time.perf_counter() - start, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--pairs", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16384, help="shardcache batch budget")
    ap.add_argument("--trl-batch", type=int, default=32, help="pairs per TRL batch")
    ap.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", default=None, help="scratch folder (default: a temp folder)")
    args = ap.parse_args()

    work = args.work or tempfile.mkdtemp(prefix="bench-pref-")
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    size = write_corpus(corpus, args.pairs, args.seed)
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "TOKENIZERS_PARALLELISM": "true", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    ours_build, ours_read, trl_build, trl_read = [], [], [], []
    facts: dict[str, object] = {}
    try:
        for r in range(args.rounds):
            cache = os.path.join(work, f"cache-{r}")
            seconds, _ = run(build_command(corpus, args.tokenizer, cache), env)
            ours_build.append(seconds)
            _, out = run([sys.executable, "-c", READ_OURS, cache, str(args.max_tokens)], env)
            read, batches, pairs, _ = out.split()
            ours_read.append(float(read))
            facts.update(ours_batches=int(batches), ours_pairs=int(pairs))
            trl_cache = os.path.join(work, f"hf-{r}")
            seconds, out = run([sys.executable, "-c", TRL_SIDE, corpus, args.tokenizer, trl_cache,
                                str(args.num_proc), str(args.trl_batch)], env)  # fmt: skip
            read, batches, pairs, _ = out.split()[1:]
            trl_build.append(seconds - float(read))  # process start + imports + load + map
            trl_read.append(float(read))
            facts.update(trl_batches=int(batches), trl_pairs=int(pairs))
            print(
                f"round {r}: shardcache build {ours_build[-1]:.1f}s read {ours_read[-1]:.1f}s;"
                f" trl build {trl_build[-1]:.1f}s read {trl_read[-1]:.1f}s",
                flush=True,
            )
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(trl_cache, ignore_errors=True)
        from shardcache import open_cache

        last = os.path.join(work, "cache-last")
        run(build_command(corpus, args.tokenizer, last), env)
        tokens = open_cache(last).num_tokens
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    ob, orr, tb, tr = min(ours_build), min(ours_read), min(trl_build), min(trl_read)
    print(
        f"{args.pairs:,} pairs ({size / 1e6:.1f} MB jsonl, {tokens:,} tokens stored, both "
        f"sides), tokenizer {args.tokenizer}; cores {os.cpu_count()}; best of {args.rounds}"
    )
    print("| phase | shardcache s | pairs/s | TRL s | pairs/s | TRL / shardcache |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ours, theirs in (("build (tokenize)", ob, tb), ("read (one pass)", orr, tr),
                               ("build + read", ob + orr, tb + tr)):  # fmt: skip
        print(f"| {name} | {ours:.1f} | {args.pairs / ours:,.0f} | {theirs:.1f} | "
              f"{args.pairs / theirs:,.0f} | {theirs / ours:.2f} |")  # fmt: skip
    print(
        f"batches: shardcache {facts['ours_batches']} (budget {args.max_tokens} tokens), "
        f"TRL {facts['trl_batches']} ({args.trl_batch} pairs)"
    )
    record_result("bench_preference", {
        "pairs": args.pairs, "tokens": tokens,
        "shardcache_build_s": ob, "shardcache_read_s": orr, "trl_build_s": tb, "trl_read_s": tr,
        "build_ratio": tb / ob, "read_ratio": tr / orr, "total_ratio": (tb + tr) / (ob + orr),
        "all_rounds": {"shardcache_build": ours_build, "shardcache_read": ours_read,
                       "trl_build": trl_build, "trl_read": trl_read},
        **facts,
    }, args)  # fmt: skip


if __name__ == "__main__":
    main()
