"""Chat build throughput vs. encoding the already-rendered strings (not part of the tests).

    python benchmarks/bench_chat.py --corpus CHAT_CORPUS --tokenizer TOKENIZER_DIR

``CHAT_CORPUS`` is a folder of jsonl files of ``{"messages": [...]}`` records (e.g. 5,000 or
20,000 conversations; ``recipes/quickstart/chat`` for a smoke run).

Measured in one run, on the same conversations and tokenizer:

* ``ceiling``: the conversations are rendered with the template first (not timed), then the
  backend's ``encode_batch`` (all cores) encodes the rendered strings;
* ``chat build``: ``shardcache.build_cache`` with ``chat=True`` (read + parse + render every
  conversation and its per-turn prefixes + encode + loss masks + lint + write + commit),
  imports warm, default workers.

Target: build tokens/s >= 0.7 x ceiling. A tokenizer without a chat template gets
``--chat-template`` (default: a ChatML-like template that ends turns with the tokenizer's EOS
or SEP token).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from results import record_result

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token or sep_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--chat-template", help="Jinja file (default: a built-in ChatML-like one)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from shardcache.builder.chat import ChatEncoder, ChatOptions
    from shardcache.builder.run import build_cache
    from shardcache.builder.sources import iter_text_batches, list_inputs
    from shardcache.builder.tokenize import TextEncoder
    from shardcache.config import TokenizeOptions, build_options_from_mapping

    work = tempfile.mkdtemp(prefix="bench-chat-")
    try:
        template = args.chat_template
        if template is None:
            template = os.path.join(work, "template.jinja")
            with open(template, "w") as f:
                f.write(TEMPLATE)
        text = TextEncoder(TokenizeOptions(args.tokenizer, append_eos=False))
        encoder = ChatEncoder(text, ChatOptions(template_path=template))
        convs = []
        for f in list_inputs([args.corpus]):
            for batch in iter_text_batches(f, text_field="messages", kind="chat"):
                convs += batch.texts
        rendered = encoder.renderer.render_texts(convs)
        del convs
        best_ceiling = None
        for _ in range(args.repeat):
            start = time.perf_counter()
            tokens = 0
            for i in range(0, len(rendered), 1024):
                for e in text.backend.encode_batch(
                    rendered[i : i + 1024], add_special_tokens=False
                ):
                    tokens += len(e)
            seconds = time.perf_counter() - start
            if best_ceiling is None or seconds < best_ceiling[0]:
                best_ceiling = (seconds, tokens)
        assert best_ceiling is not None
        best = None
        for i in range(args.repeat):
            values = {"input": args.corpus, "tokenizer": args.tokenizer, "chat": True,
                      "chat_template": template, "output": os.path.join(work, f"c{i}"),
                      "workers": args.workers}  # fmt: skip
            report = build_cache(build_options_from_mapping(values))
            best = report if best is None or report.seconds < best.seconds else best
        assert best is not None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ceil_tps = best_ceiling[1] / best_ceiling[0]
    build_tps = best.tokens / best.seconds
    print(f"corpus {args.corpus}: {best.documents:,} conversations, {best.tokens:,} tokens "
          f"stored, {len(rendered):,} rendered; cores {os.cpu_count()}")  # fmt: skip
    print("| run | tokens/s | ratio |")
    print("|---|---:|---:|")
    print(f"| ceiling: encode_batch(rendered strings) | {ceil_tps:,.0f} | 1.00 |")
    print(f"| chat build (render + masks + lint + write) | {build_tps:,.0f} | "
          f"{build_tps / ceil_tps:.2f} |")  # fmt: skip
    record_result("bench_chat", {
        "conversations": best.documents, "tokens": best.tokens,
        "ceiling_tokens_per_s": ceil_tps, "build_tokens_per_s": build_tps,
        "ratio": build_tps / ceil_tps,
    }, args)  # fmt: skip


if __name__ == "__main__":
    main()
