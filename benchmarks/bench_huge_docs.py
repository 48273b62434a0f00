"""Peak memory and ids of huge documents without ASCII spaces (issue 13 item 10).

    python benchmarks/bench_huge_docs.py --tokenizer TOKENIZER_DIR --chars 10000000 \
        [--kind cjk|code|base64] [--whole]

Writes one jsonl record of ``--chars`` characters of the chosen kind (CJK with punctuation,
minified code, base64) and runs ``shardcache build --workers 1`` on it in a child process,
reporting the child's peak RSS (``ru_maxrss``) and the build time. ``--whole`` also encodes
the document whole in a second child (the pre-issue behaviour: 10 M CJK characters peaked at
6.7 GB) and checks that the cache holds exactly those ids.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from results import record_result


def make_text(kind: str, chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    if kind == "cjk":
        alphabet, marks = "東京データ日本語の文章です中文字符学习研究", ["", "", "", "。", "、"]
        parts = [rng.choice(alphabet) + rng.choice(marks) for _ in range(chars // 2 + 1)]
        return "".join(parts)[:chars]
    if kind == "code":
        parts = [f"f{i}=(a,b)=>{{a*={i};return(a+b);}};x{i}=f{i}(1,2);" for i in range(chars // 30)]
        return "".join(parts)[:chars]
    return base64.b64encode(rng.randbytes(chars * 3 // 4 + 3)).decode()[:chars]


def child_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


WHOLE = """
import json, sys, numpy as np
from tokenizers import Tokenizer
from shardcache.builder.tokenize import load_hf_tokenizer
from shardcache import open_cache
hf = load_hf_tokenizer(sys.argv[1])
text = json.loads(open(sys.argv[2]).readline())["text"]
ids = hf.backend_tokenizer.encode(text).ids
seq = next(open_cache(sys.argv[3]).iter_sequences()).ids.tolist()
eos = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
print("same ids:", seq[: len(ids)] == ids and seq[len(ids):] in ([], [eos]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--chars", type=int, default=10_000_000)
    parser.add_argument("--kind", choices=["cjk", "code", "base64"], default="cjk")
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "huge.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            f.write(json.dumps({"text": make_text(args.kind, args.chars)}, ensure_ascii=False))
            f.write("\n")
        out = os.path.join(tmp, "cache")
        cmd = [sys.executable, "-m", "shardcache.cli", "build", "-i", data, "-t", args.tokenizer,
               "-o", out, "-w", "1", "-q", "--json"]  # fmt: skip
        started = time.perf_counter()
        report = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
        seconds = time.perf_counter() - started
        build_peak_mb = child_peak_mb()
        print(f"{args.kind} {args.chars:,} chars: {report['tokens']:,} tokens, {seconds:.1f} s, "
              f"peak RSS {build_peak_mb:,.0f} MB (build process)")  # fmt: skip
        figures = {"tokens": report["tokens"], "seconds": seconds, "peak_rss_mb": build_peak_mb}
        if args.whole:
            check = [sys.executable, "-c", WHOLE, args.tokenizer, data, out]
            print(subprocess.run(check, check=True, capture_output=True, text=True).stdout.strip())
            figures["whole_peak_rss_mb"] = child_peak_mb()
            print(
                f"peak RSS of the two children: {figures['whole_peak_rss_mb']:,.0f} MB "
                "(whole encode)"
            )
        record_result("bench_huge_docs", figures, args)


if __name__ == "__main__":
    main()
