"""Tests of megatron_ucp.train.data: deterministic samples and layout-independent batching."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_ucp.errors import ConfigError
from megatron_ucp.train.data import MockGPTDataset, build_dataset, microbatch_sample_indices, microbatches


class IndexDataset:
    """Sample i is seq_length+1 copies of i, so a batch tells which samples it holds."""

    def __init__(self, seq_length):
        self.seq_length = seq_length

    def __len__(self):
        return 10**12

    def __getitem__(self, i):
        return np.full(self.seq_length + 1, i, dtype=np.int64)


# ---------------------------------------------------------------- mock data


def test_mock_samples_are_deterministic_and_distinct():
    a = MockGPTDataset(vocab_size=500, seq_length=16, seed=3)
    b = MockGPTDataset(vocab_size=500, seq_length=16, seed=3)
    for i in [0, 1, 7, 12345, 2**40]:
        x = a[i]
        assert x.dtype == np.int64 and x.shape == (17,)
        assert ((0 <= x) & (x < 500)).all()
        np.testing.assert_array_equal(x, b[i])
    samples = [a[i] for i in range(50)]
    assert len({s.tobytes() for s in samples}) == 50
    other_seed = MockGPTDataset(vocab_size=500, seq_length=16, seed=4)
    assert any(not np.array_equal(a[i], other_seed[i]) for i in range(10))
    assert len(a) >= 2**40


def test_mock_next_token_mostly_follows_one_fixed_permutation():
    """The learnable signal: one transition map shared by all samples, a permutation of m ids."""
    ds = MockGPTDataset(vocab_size=300, seq_length=32, seed=0)
    transition = {}
    follows = total = 0
    for i in range(300):
        x = ds[i]
        step = (ds.multiplier * x[:-1] + ds.increment) % ds.modulus
        follows += int((step == x[1:]).sum())
        total += len(x) - 1
        for cur, nxt in zip(x[:-1].tolist(), step.tolist()):
            transition[cur] = nxt
    assert 0.9 < follows / total < 1.0  # mostly predictable, with a few random restarts
    assert len(set(transition.values())) == len(transition) > 250  # a permutation of ~all ids


def test_mock_large_vocab_uses_active_subset():
    ds = MockGPTDataset(vocab_size=50304, seq_length=64, seed=1)
    tokens = np.concatenate([ds[i] for i in range(100)])
    assert tokens.max() < 1024
    small = MockGPTDataset(vocab_size=50304, seq_length=8, seed=1, active_vocab=16)
    assert max(small[i].max() for i in range(20)) < 16


def test_mock_rejects_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        MockGPTDataset(vocab_size=1, seq_length=8, seed=0)
    with pytest.raises(IndexError):
        MockGPTDataset(vocab_size=10, seq_length=8, seed=0)[-1]


# ---------------------------------------------------------------- batching


@settings(max_examples=60, deadline=None)
@given(dp_size=st.integers(1, 8), mbs=st.integers(1, 4), num_mb=st.integers(1, 4),
       consumed=st.integers(0, 10_000), seq=st.integers(1, 5))
def test_microbatches_partition_global_batch(dp_size, mbs, num_mb, consumed, seq):
    gbs = dp_size * mbs * num_mb
    ds = IndexDataset(seq)
    by_position = {}  # (microbatch, dp_rank, row) -> global sample index
    mask_total = 0.0
    for rank in range(dp_size):
        batches = microbatches(ds, consumed, gbs, mbs, rank, dp_size)
        assert len(batches) == num_mb
        for m, b in enumerate(batches):
            assert b["tokens"].shape == b["labels"].shape == (mbs, seq)
            assert b["tokens"].dtype == b["labels"].dtype == b["position_ids"].dtype == torch.int64
            assert b["loss_mask"].dtype == torch.float32 and (b["loss_mask"] == 1).all()
            assert (b["position_ids"] == torch.arange(seq)).all()
            mask_total += float(b["loss_mask"].sum())
            for k in range(mbs):
                by_position[(m, rank, k)] = int(b["tokens"][k, 0])
    # Read in Megatron's global order (micro-batch step, then rank, then row) the samples are
    # exactly the global batch, each once and in order, whatever the layout.
    in_order = [by_position[key] for key in sorted(by_position)]
    assert in_order == list(range(consumed, consumed + gbs))
    assert mask_total == gbs * seq


@settings(max_examples=25, deadline=None)
@given(dp_size=st.sampled_from([1, 2, 4]), mbs=st.sampled_from([1, 2, 4]),
       consumed=st.integers(0, 1000))
def test_same_tokens_whatever_the_layout(dp_size, mbs, consumed):
    ds = MockGPTDataset(vocab_size=97, seq_length=6, seed=11)
    gbs = 16

    def global_batch(dp, mb):
        rows = {}
        for r in range(dp):
            for m, b in enumerate(microbatches(ds, consumed, gbs, mb, r, dp)):
                for k in range(mb):
                    rows[(m, r, k)] = (b["tokens"][k], b["labels"][k])
        ordered = [rows[key] for key in sorted(rows)]
        return torch.stack([t for t, _ in ordered]), torch.stack([lab for _, lab in ordered])

    ref_tokens, ref_labels = global_batch(1, gbs)
    tokens, labels = global_batch(dp_size, mbs)
    assert torch.equal(tokens, ref_tokens) and torch.equal(labels, ref_labels)
    assert torch.equal(ref_tokens[:, 1:], ref_labels[:, :-1])  # labels are tokens shifted by one
    assert torch.equal(ref_tokens[0], torch.from_numpy(ds[consumed][:-1]))


def test_consecutive_iterations_continue_from_consumed_samples():
    ds = IndexDataset(2)
    seen = []
    for it in range(3):
        for b in microbatches(ds, it * 8, 8, 2, 0, 1):
            seen += b["tokens"][:, 0].tolist()
    assert seen == list(range(24))


def test_microbatches_rejects_indivisible_and_bad_rank():
    with pytest.raises(ValueError, match=r"global_batch_size 10 .* micro_batch_size 2 .* size 3"):
        microbatch_sample_indices(0, 10, 2, 0, 3)
    with pytest.raises(ValueError, match="dp_rank 3"):
        microbatch_sample_indices(0, 12, 2, 3, 3)
    assert microbatch_sample_indices(5, 8, 2, 1, 2) == [[7, 8], [11, 12]]


# ---------------------------------------------------------------- build_dataset


def test_build_dataset():
    assert isinstance(build_dataset(None, True, 100, 8, 0), MockGPTDataset)
    with pytest.raises(ConfigError, match="no training data"):
        build_dataset(None, False, 100, 8, 0)
    with pytest.raises(ConfigError, match="not both"):
        build_dataset("corpus", True, 100, 8, 0)
    with pytest.raises(ConfigError, match="GPTDataset"):  # tests/test_megatron_data.py
        build_dataset("corpus", False, 100, 8, 0)
