"""Megatron-FSDP's row shards in the mapping (mcore/megatron_fsdp.restrict): megatron's boxes of a
whole tensor-parallel-local parameter, cut to the flat rows [start, stop) one data-parallel rank
holds, select exactly those elements of the global tensor (checked against a brute-force
assembly, for every tensor-parallel rule and row-aligned shard)."""

from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import LayoutError
from megatron_ucp.format.layout import Box, Rule, boxes_of
from megatron_ucp.mcore.megatron_fsdp import restrict

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    """(global shape, boxes of one TP rank's local tensor, its row size, local rows, start, stop)."""
    kind = draw(st.sampled_from(["replicated", "split0", "split1", "gated", "vocab"]))
    tp = draw(st.integers(1, 4))
    tp_rank = draw(st.integers(0, tp - 1))
    cols = draw(st.integers(1, 4))
    per = draw(st.integers(1, 4))
    one_dim = kind in ("replicated", "split0") and draw(st.booleans())
    if kind == "gated":
        atomic, rule, padded = (2 * tp * per, cols), Rule("gated"), None
    elif kind == "vocab":
        vocab = draw(st.integers(1, tp * per))
        atomic, rule, padded = (vocab, cols), Rule("vocab"), tp * per
    elif kind == "split1":
        atomic, rule, padded = (per, tp * cols), Rule("split", 1), None
    else:
        rows = tp * per if kind == "split0" else per
        atomic = (rows,) if one_dim else (rows, cols)
        rule, padded = (Rule("split", 0) if kind == "split0" else Rule("replicated")), None
    boxes = tuple(boxes_of(rule, atomic, tp, tp_rank, padded))
    global_shape = ((padded,) + atomic[1:]) if padded else atomic
    row = prod(boxes[0].shape[1:])
    local_rows = sum(b.shape[0] for b in boxes)
    a = draw(st.integers(0, local_rows))
    b = draw(st.integers(a, local_rows))
    return global_shape, boxes, row, local_rows, a * row, b * row


def _assemble(global_values, boxes, numel):
    """The local flat tensor the boxes describe (each box's global block at its local start)."""
    out = np.full(numel, -1, dtype=np.int64)
    for b in boxes:
        block = global_values[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape))]
        out[b.local_start:b.local_start + block.size] = block.reshape(-1)
    return out


@SETTINGS
@given(cases())
def test_restricted_boxes_select_the_shards_elements(case):
    global_shape, boxes, row, local_rows, start, stop = case
    values = np.arange(prod(global_shape)).reshape(global_shape)
    local = _assemble(values, boxes, local_rows * row)
    cut = restrict(boxes, row, start, stop)
    assert sum(prod(b.shape) for b in cut) == stop - start
    assert np.array_equal(_assemble(values, cut, stop - start), local[start:stop])


def test_a_shard_that_cuts_a_row_is_refused():
    with pytest.raises(LayoutError, match=r"cuts rows of 4 elements"):
        restrict((Box(0, (0, 0), (3, 4)),), 4, 2, 8)


def test_an_empty_shard_holds_no_box():
    assert restrict((Box(0, (0, 0), (3, 4)),), 4, 0, 0) == ()
