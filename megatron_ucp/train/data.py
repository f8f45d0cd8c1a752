"""Training data: deterministic samples addressed by global sample index.

Every sample is a pure function of its global index, and the iteration that starts after
``consumed_samples`` always reads samples ``consumed_samples .. consumed_samples + global_batch_size
- 1``. So the tokens a run trains on depend only on the consumed-sample count, never on the
parallel layout, and a run resumed from a (universal) checkpoint continues exactly where it stopped.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch

from megatron_ucp.errors import ConfigError

# The mock data uses only this many distinct token ids (or fewer if the vocabulary is smaller), so a
# tiny model sees each token often enough in its first few iterations to learn the transitions.
MOCK_ACTIVE_VOCAB = 1024
# Probability that a mock token restarts the recurrence at a fresh random token: keeps samples
# distinct (a sample is not fixed by its first token) while 15/16 of the tokens stay predictable.
MOCK_RESTART_PROB = 1 / 16


class MockGPTDataset:
    """Deterministic synthetic sequences with a learnable structure.

    Sample ``i`` is drawn from ``Generator(PCG64([seed, i]))`` alone. It follows the fixed affine
    recurrence ``x[t+1] = (a * x[t] + b) mod m`` over the first ``m`` = ``min(vocab_size,
    active_vocab)`` token ids (``a`` coprime with ``m``, so the map is a permutation), starting at
    a random token and restarting at a fresh random token with probability ``MOCK_RESTART_PROB``
    per position. A tiny GPT first learns that only ``m`` ids occur (loss drops from
    ``ln vocab_size`` towards ``ln m``) and then the bigram map (loss towards ~0.7 nats), which
    makes "loss falls" a meaningful smoke test.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, *,
                 active_vocab: int = MOCK_ACTIVE_VOCAB):
        if vocab_size < 2 or seq_length < 1 or active_vocab < 2:
            raise ValueError(
                f"MockGPTDataset needs vocab_size >= 2, seq_length >= 1 and active_vocab >= 2, "
                f"got vocab_size={vocab_size}, seq_length={seq_length}, "
                f"active_vocab={active_vocab}")
        if seed < 0:
            raise ValueError(f"MockGPTDataset needs a non-negative seed, got {seed}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.modulus = min(vocab_size, active_vocab)
        m = self.modulus
        self.multiplier = next(a for a in range(5, 5 + m) if math.gcd(a, m) == 1)
        self.increment = 7 % m
        # t steps from x give (A[t] * x + B[t]) mod m; precomputed so a sample is vector operations.
        coef = np.empty((2, seq_length + 1), dtype=np.int64)
        a_t, b_t = 1, 0
        for t in range(seq_length + 1):
            coef[:, t] = a_t, b_t
            a_t, b_t = (self.multiplier * a_t) % m, (self.multiplier * b_t + self.increment) % m
        self._coef = coef

    def __len__(self) -> int:
        # Effectively infinite: a run never wraps around.
        return sys.maxsize

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"MockGPTDataset index {i} out of range")
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        n = self.seq_length + 1
        restart = rng.random(n) < MOCK_RESTART_PROB
        restart[0] = True
        starts = rng.integers(self.modulus, size=n)
        positions = np.arange(n)
        last_restart = np.maximum.accumulate(np.where(restart, positions, 0))
        steps = positions - last_restart
        return (self._coef[0][steps] * starts[last_restart] + self._coef[1][steps]) % self.modulus


class IndexedGPTDataset:
    """Samples cut from a Megatron indexed dataset (``<prefix>.bin`` / ``<prefix>.idx``).

    All sequences are concatenated in file order (no shuffling, no document boundaries or EOD
    handling: reproducibility and simplicity over sample quality) and cut into consecutive windows
    of ``seq_length`` tokens; sample ``j`` is tokens ``j*seq_length .. (j+1)*seq_length``, i.e. the
    window plus the next token for the last label. ``len`` is the number of full samples; indices
    beyond it wrap around (``j % len``), so a run longer than one epoch re-reads the data in the
    same order. Token ids are checked against ``vocab_size`` when a sample is read.
    """

    def __init__(self, path_prefix: str, seq_length: int, vocab_size: int):
        # Imported here: megatron.core takes seconds to import and the mock path does not need it.
        from megatron.core.datasets.indexed_dataset import (
            IndexedDataset, get_bin_path, get_idx_path)

        if seq_length < 1 or vocab_size < 1:
            raise ValueError(f"IndexedGPTDataset needs seq_length >= 1 and vocab_size >= 1, "
                             f"got seq_length={seq_length}, vocab_size={vocab_size}")
        self.path_prefix = path_prefix
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.bin_path = get_bin_path(path_prefix)
        self.idx_path = get_idx_path(path_prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"indexed dataset file {path} not found (data path prefix {path_prefix!r} "
                    f"needs both {path_prefix}.bin and {path_prefix}.idx)")
        if os.path.getsize(self.bin_path) == 0:
            raise ValueError(f"indexed dataset file {self.bin_path} is empty")
        try:
            self._data = IndexedDataset(path_prefix, mmap=True)
        except (AssertionError, ValueError, OSError) as e:
            raise ValueError(
                f"cannot read indexed dataset {self.idx_path} / {self.bin_path}: {e}") from e

        lengths = np.asarray(self._data.sequence_lengths, dtype=np.int64)
        self._ends = np.cumsum(lengths)  # token offset one past the end of each sequence
        self._starts = self._ends - lengths
        self.num_tokens = int(self._ends[-1]) if len(lengths) else 0
        self._len = (self.num_tokens - 1) // seq_length if self.num_tokens else 0
        if self._len == 0:
            raise ValueError(
                f"indexed dataset {self.bin_path} holds {self.num_tokens} tokens, fewer than the "
                f"{seq_length + 1} one sample of seq_length {seq_length} needs")

    def __len__(self) -> int:
        return self._len

    def _read_tokens(self, start: int, count: int) -> np.ndarray:
        """Tokens ``start .. start+count-1`` of the concatenation, possibly spanning sequences."""
        pieces = []
        seq = int(np.searchsorted(self._ends, start, side="right"))  # skips empty sequences
        pos, left = start, count
        while left > 0:
            offset = pos - int(self._starts[seq])
            n = min(left, int(self._ends[seq]) - pos)
            if n > 0:
                pieces.append(self._data.get(seq, offset=offset, length=n))
                pos, left = pos + n, left - n
            seq += 1
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if i < 0:
            raise IndexError(f"IndexedGPTDataset index {i} is negative")
        tokens = self._read_tokens((i % self._len) * self.seq_length, self.seq_length + 1)
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bad.any():
            token = int(tokens[np.argmax(bad)])
            raise ValueError(
                f"indexed dataset {self.bin_path} holds token id {token}, outside the model's "
                f"vocabulary of size {self.vocab_size} (sample {i})")
        return tokens


def build_dataset(data_path: str | None, mock: bool, vocab_size: int, seq_length: int, seed: int):
    """The dataset a run trains on: mock data or an indexed dataset at ``data_path`` (a prefix)."""
    if mock and data_path:
        raise ConfigError(
            f"give either mock data or a data path, not both (data path {data_path!r})")
    if mock:
        return MockGPTDataset(vocab_size, seq_length, seed)
    if data_path:
        return IndexedGPTDataset(data_path, seq_length, vocab_size)
    raise ConfigError(
        "no training data: give a data path prefix (<prefix>.bin/.idx) or ask for mock data")


def microbatch_sample_indices(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                              dp_rank: int, dp_size: int) -> list[list[int]]:
    """Global sample indices of each micro-batch this DP rank runs in the next iteration.

    Split as Megatron's pretraining sampler does: micro-batch step ``m`` covers
    ``micro_batch_size * dp_size`` consecutive samples and rank ``r`` takes the ``r``-th slice of
    ``micro_batch_size`` of them.
    """
    if min(global_batch_size, micro_batch_size, dp_size) < 1 or consumed_samples < 0:
        raise ValueError(
            f"need positive batch sizes and dp_size and non-negative consumed_samples, got "
            f"global_batch_size={global_batch_size}, micro_batch_size={micro_batch_size}, "
            f"dp_size={dp_size}, consumed_samples={consumed_samples}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    step = micro_batch_size * dp_size
    if global_batch_size % step:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by micro_batch_size "
            f"{micro_batch_size} * data-parallel size {dp_size}")
    first = consumed_samples + dp_rank * micro_batch_size
    return [list(range(first + m * step, first + m * step + micro_batch_size))
            for m in range(global_batch_size // step)]


def make_batch(samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """A GPT micro-batch in Megatron's layout from samples of ``seq_length + 1`` tokens."""
    data = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))
    tokens = data[:, :-1].contiguous()
    labels = data[:, 1:].contiguous()
    mbs, seq = tokens.shape
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(mbs, seq, dtype=torch.float32),
        "position_ids": torch.arange(seq, dtype=torch.int64).expand(mbs, seq).contiguous(),
    }


def microbatches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """The micro-batches (CPU tensors) this DP rank processes in the iteration after
    ``consumed_samples`` global samples; see :func:`microbatch_sample_indices` for the split."""
    indices = microbatch_sample_indices(consumed_samples, global_batch_size, micro_batch_size,
                                        dp_rank, dp_size)
    return [make_batch([dataset[i] for i in mb]) for mb in indices]
