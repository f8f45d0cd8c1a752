"""`--moe-layer-freq` read as data (mcore/layer_pattern.py): Megatron-LM's pattern forms parse
to what Python makes of them, and text from a checkpoint that would hang or exhaust `eval`
('9**9**9', '[1]*10**9') is refused at once."""

import time

import pytest
from hypothesis import given, settings, strategies as st

from megatron_ucp.convert.source_model import argv_from_args, source_args
from megatron_ucp.errors import FormatError
from megatron_ucp.mcore import layer_pattern
from megatron_ucp.mcore.layer_pattern import PatternError, parse

_bits = st.lists(st.integers(0, 1), min_size=1, max_size=6)


@st.composite
def patterns(draw, depth=0):
    """(text, the list it means): literals, '+' of patterns, '*' by a small count, parentheses."""
    kind = draw(st.sampled_from(["literal", "add", "times", "paren"] if depth < 3 else ["literal"]))
    if kind == "literal":
        bits = draw(_bits)
        return "[" + draw(st.sampled_from([",", ", "])).join(map(str, bits)) + "]", bits
    if kind == "paren":
        text, value = draw(patterns(depth + 1))
        return f"({text})", value
    (a, va), (b, vb) = draw(patterns(depth + 1)), draw(patterns(depth + 1))
    if kind == "add":
        return f"{a}+{b}", va + vb
    n = draw(st.integers(0, 4))
    return (f"({a})*{n}", va * n) if draw(st.booleans()) else (f"{n}*({a})", n * va)


@settings(max_examples=300, deadline=None)
@given(patterns())
def test_patterns_mean_what_python_makes_of_them(case):
    text, value = case
    assert parse(text) == value


@pytest.mark.parametrize("text,expected", [
    ("2", 2), (" 4 ", 4), ("([0]+[1])*2", [0, 1, 0, 1]), ("[1,0,1]", [1, 0, 1]), ("[0]+[1]*3", [0, 1, 1, 1]),
    ("([1]*3+[0]*1)*3", [1, 1, 1, 0] * 3), ("[1]*2*3", [1] * 6), ("[]", []),
])
def test_megatron_forms(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("text,words", [
    ("9**9**9", "expected an integer"),  # eval: hangs
    ("[1]*10**9", "expected an integer"),  # eval: an 8 GB list
    ("[1]*1000000000", "exceeds"),
    ("[1]*100000*100000", "exceeds"),
    ("([1]*9000)+([1]*9000)", "exceeds"),
    ("9" * 5000, "exceeds"),
    ("(" * 100 + "1" + ")" * 100, "nested deeper"),
    ("[1]" + "+[1]" * 12000, "exceeds"),
    ("__import__('os').system('x')", "unexpected character"),
    ("[2,1]", "0 (dense) and 1 (MoE)"),
    ("[0,", "expected"),
    ("[[1]]", "integers, not lists"),
    ("[1]*[1]", "not by a list"),
    ("[1]+1", "not a list and an integer"),
    ("x" * 70000, "characters"),
])
def test_hostile_text_is_refused_at_once(text, words):
    start = time.perf_counter()
    with pytest.raises(PatternError) as e:
        parse(text)
    assert words in str(e.value)
    assert time.perf_counter() - start < 1.0


def test_a_long_list_literal_within_the_bound_parses():
    bits = [1, 0] * (layer_pattern.MAX_LAYERS // 2)
    assert parse(str(bits)) == bits


@pytest.mark.parametrize("value", ["9**9**9", "[1]*10**9", "__import__('os')"])
def test_converters_name_the_file_of_a_stored_pattern(value):
    """torch_dist's common.pt and a legacy model_optim_rng.pt reach the flag parser through
    source_args (the converters' and export_torch_dist's path): one line naming the file."""
    stored = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_experts": 4,
              "disable_bias_linear": True, "moe_layer_freq": value, "world_size": 1}
    start = time.perf_counter()
    with pytest.raises(FormatError) as e:
        source_args(argv_from_args(stored) + ["--cpu"], 1, "ckpt/iter_0000001/common.pt")
    assert str(e.value).startswith("ckpt/iter_0000001/common.pt: argument --moe-layer-freq")
    assert time.perf_counter() - start < 2.0
