"""Block checksums from the load's own reads: crc32 combination, who hashes which bytes, and the
check that puts the pieces back together (megatron_ucp/format/checksums.py)."""

import os
import random
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.format.checksums import assign_pieces, check_blocks, crc32_combine, spread


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combine_is_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_over_long_lengths():
    """Lengths far beyond a block: the shift by 8 * n bits must use every power it needs."""
    a = b"x" * 7
    for n in (2**20 + 3, 4 * 2**20, 2**24 + 12345):
        b = bytes(n)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)


@st.composite
def files_and_reads(draw):
    base = draw(st.integers(0, 40))
    end = base + draw(st.integers(0, 600))
    block = draw(st.integers(1, 130))
    ranks = draw(st.integers(1, 4))
    spans = {}
    for r in range(ranks):
        cuts = sorted(draw(st.lists(st.integers(base, end), max_size=8)))
        spans[r] = [(lo, hi) for lo, hi in zip(cuts[::2], cuts[1::2]) if lo < hi]
    return base, end, block, spans


def _tiles(pieces, base, end, block):
    pos = base
    for lo, hi in sorted(pieces):
        assert lo == pos and lo < hi
        assert (lo - base) // block == (hi - 1 - base) // block, f"piece {lo}..{hi} crosses a block"
        pos = hi
    assert pos == end


@settings(max_examples=300, deadline=None)
@given(files_and_reads(), st.randoms(use_true_random=False))
def test_pieces_tile_the_file_and_check_out(case, rnd):
    """Every byte hashed once, by a rank that reads it in one read, or in the pass after; the
    pieces' crcs then reproduce every block's sum, and a flipped byte fails exactly its block."""
    base, end, block, spans = case
    owned, unread = assign_pieces(spans, base, end, block)
    for rank, pieces in owned.items():
        for lo, hi in pieces:
            assert any(a <= lo and hi <= b for a, b in spans[rank]), (rank, lo, hi)
    for lo, hi in unread:
        assert not any(a < hi and lo < b for s in spans.values() for a, b in s)
    _tiles([p for ps in owned.values() for p in ps] + unread, base, end, block)
    data = bytearray(rnd.randbytes(end))
    sums = [f"{zlib.crc32(data[lo:min(lo + block, end)]):08x}" for lo in range(base, end, block)]
    hashed = lambda d: [(lo, hi, zlib.crc32(d[lo:hi])) for ps in list(owned.values()) + [unread]  # noqa: E731
                        for lo, hi in ps]
    assert check_blocks("f", base, end, block, sums, hashed(data)) == []
    if end > base:
        at = rnd.randrange(base, end)
        data[at] ^= 1
        problems = check_blocks("f", base, end, block, sums, hashed(data))
        assert len(problems) == 1 and f"block {(at - base) // block} " in problems[0], problems


def test_replicas_share_the_hashing():
    """Four ranks reading the same 64 blocks (DP replicas of a weight) hash 16 each."""
    owned, unread = assign_pieces({r: [(0, 64 * 100)] for r in range(4)}, 0, 64 * 100, 100)
    assert unread == [] and [sum(hi - lo for lo, hi in owned[r]) for r in range(4)] == [1600] * 4


def test_a_missing_or_doubled_piece_is_reported():
    data = os.urandom(1000)
    sums = [f"{zlib.crc32(data[lo:lo + 100]):08x}" for lo in range(0, 1000, 100)]
    pieces = [(lo, lo + 100, zlib.crc32(data[lo:lo + 100])) for lo in range(0, 1000, 100)]
    assert check_blocks("f", 0, 1000, 100, sums, pieces) == []
    assert "were not hashed" in check_blocks("f", 0, 1000, 100, sums, pieces[:4] + pieces[5:])[0]
    assert "not hashed (or twice)" in check_blocks("f", 0, 1000, 100, sums, pieces + [(150, 160, 0)])[0]
    assert "beyond byte" in check_blocks("f", 0, 1000, 100, sums, pieces + [(1000, 1010, 0)])[0]


@given(st.dictionaries(st.text("ab", min_size=1, max_size=3),
                       st.lists(st.integers(1, 50), max_size=6), max_size=5), st.integers(1, 5))
def test_spread_hands_out_every_piece_once_and_balances(sizes, world):
    pieces = {name: [(i * 100, i * 100 + n) for i, n in enumerate(ns)] for name, ns in sizes.items()}
    out = spread(pieces, world)
    assert sorted(x for r in out for x in r) == sorted((n, lo, hi) for n, ps in pieces.items() for lo, hi in ps)
    loads = [sum(hi - lo for _, lo, hi in r) for r in out]
    largest = max((hi - lo for ps in pieces.values() for lo, hi in ps), default=0)
    assert max(loads) - min(loads) <= largest


def test_random_reads_of_a_real_block_size():
    """A 4 MiB-block file read by DP fragments whose edges fall inside blocks."""
    rnd = random.Random(0)
    base, block = 123, 4 * 2**20
    end = base + 3 * 5_000_000
    data = rnd.randbytes(end)
    sums = [f"{zlib.crc32(data[lo:min(lo + block, end)]):08x}" for lo in range(base, end, block)]
    weights = (base, base + 5_000_000)
    spans = {r: [weights] + [(base + 5_000_000 * k + r * 1_250_000, base + 5_000_000 * k + (r + 1) * 1_250_000)
                             for k in (1, 2)] for r in range(4)}
    owned, unread = assign_pieces(spans, base, end, block)
    assert unread == []
    pieces = [(lo, hi, zlib.crc32(data[lo:hi])) for ps in owned.values() for lo, hi in ps]
    assert check_blocks("f", base, end, block, sums, pieces) == []


def test_the_inline_threshold_must_be_a_positive_integer(monkeypatch):
    import pytest

    from megatron_ucp.errors import ConfigError
    from megatron_ucp.settings import inline_hash_bytes

    monkeypatch.delenv("UCP_INLINE_HASH_BYTES", raising=False)
    assert inline_hash_bytes() == 256 * 2**10
    monkeypatch.setenv("UCP_INLINE_HASH_BYTES", "4096")
    assert inline_hash_bytes() == 4096
    for bad in ("0", "-1", "1k", ""):
        monkeypatch.setenv("UCP_INLINE_HASH_BYTES", bad)
        with pytest.raises(ConfigError, match="UCP_INLINE_HASH_BYTES"):
            inline_hash_bytes()
