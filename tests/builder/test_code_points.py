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
