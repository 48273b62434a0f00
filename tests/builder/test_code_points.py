"""The code points a compiled library is trusted on, and the documents routed to HF."""

from __future__ import annotations

import numpy as np

from shardcache.builder.code_points import CODE_POINTS, Trusted, assigned_table, proven_table


def test_unassigned_surrogate_and_private_code_points_are_not_trusted():
    table = proven_table()
    assert table.shape == (CODE_POINTS,) and table.dtype == bool
    for c in ("a", "é", "東", "🙂", "\u0301", " ", "\n"):
        assert table[ord(c)], c
    # unassigned in Python's tables (U+A7D2, U+3334C, U+0378), a surrogate, private use
    for code in (0xA7D2, 0x3334C, 0x0378, 0xD800, 0xE000, 0x10FFFD):
        assert not table[code], hex(code)
    assert not (table & ~assigned_table()).any()


def test_outside_finds_every_document_holding_an_untrusted_code_point():
    texts = ["ascii only", "\ua7d2[D", "", "東京 🙂", "x\U0003334c", "\ud800 lone", "ok \u0378"]
    trusted = Trusted(proven_table())
    assert trusted.outside(texts).tolist() == [1, 4, 5, 6]
    assert trusted.outside(["plain", ""]).tolist() == []
    assert trusted.outside(["東京", "é"]).tolist() == []
    table = np.ones(CODE_POINTS, dtype=bool)
    table[ord("z")] = False
    assert Trusted(table).outside(["abc", "東z", "z"]).tolist() == [1, 2]


def test_routing_only_non_ascii_texts_decides_as_looking_at_every_code_point():
    """A document of every Unicode category (one code point each, alone and inside ASCII
    text), unassigned, surrogate and private-use points among them: the fast ``outside`` routes
    exactly the documents the every-code-point reference routes."""
    import random
    import unicodedata

    rng = random.Random(0)
    by_category: dict[str, list[int]] = {}
    for c in range(CODE_POINTS):
        by_category.setdefault(unicodedata.category(chr(c)), []).append(c)
    assert len(by_category) == 30  # every general category, Cn, Cs and Co included
    texts = []
    for points in by_category.values():
        for c in rng.sample(points, min(40, len(points))):
            texts += [chr(c), f"plain ascii {chr(c)} text", "only ascii here"]
    rng.shuffle(texts)
    trusted = Trusted(proven_table())
    for size in (1, 7, 256, len(texts)):
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        fast = [trusted.outside(b).tolist() for b in batches]
        reference = [trusted.outside_all(b).tolist() for b in batches]
        assert fast == reference
    assert sum(map(len, fast)) > 0 and trusted.outside(["ascii", "only"]).size == 0


def test_the_proven_table_is_remembered_on_disk_as_computed(tmp_path, monkeypatch):
    from shardcache.builder import code_points

    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path))
    computed = code_points.computed_table
    code_points.proven_table.cache_clear()
    try:
        first = code_points.proven_table()  # computed, then written
        assert list((tmp_path / "code_points").iterdir())
        code_points.proven_table.cache_clear()
        monkeypatch.setattr(code_points, "computed_table", None)  # the memo must answer
        again = code_points.proven_table()
    finally:
        code_points.proven_table.cache_clear()
    assert np.array_equal(first, again) and np.array_equal(first, computed())
