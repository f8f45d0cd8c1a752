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


class GPTSamples:
    """One split of megatron-core's ``GPTDataset`` (or ``BlendedDataset`` of them), by global index.

    Megatron shuffles documents and samples once, from the seed, when it builds the index files;
    sample ``i`` is then fixed, so a run that resumes after ``consumed`` samples on any layout reads
    what the uninterrupted run would. Indices past the end wrap around (``i % len``). Token ids
    are checked against the model's vocabulary when a sample is read.
    """

    KEYS = ("tokens", "labels", "loss_mask", "position_ids")

    def __init__(self, dataset, vocab_size: int, name: str):
        self.dataset, self.vocab_size, self.name = dataset, vocab_size, name
        self._len = len(dataset)
        if self._len == 0:
            raise ConfigError(f"the {name} split of --data-path holds no sample")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict:
        sample = self.dataset[int(i) % self._len]
        ids = torch.cat([sample["tokens"], sample["labels"]])
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"--data-path holds token id {int(ids[bad][0])}, outside the model's vocabulary of "
                f"size {self.vocab_size} ({self.name} sample {i})")
        # attention_mask: [1, s, s], True where attention is blocked (--reset-attention-mask)
        return {k: sample[k] for k in self.KEYS + ("attention_mask",) if k in sample}


class OffsetSamples:
    """Samples ``offset + i`` of a dataset: mock validation data, disjoint from training's."""

    def __init__(self, dataset, offset: int):
        self.dataset, self.offset = dataset, offset

    def __getitem__(self, i: int):
        return self.dataset[self.offset + int(i)]


# Mock validation samples start here: training never consumes 2**62 samples.
MOCK_VALIDATION_OFFSET = 2**62


def split_sizes(args) -> list[int]:
    """Samples per split, as Megatron-LM asks the builder for them (train, valid, test).

    The train split's size, hence its shuffle, depends on --train-iters: a resumed run keeps it,
    as in Megatron-LM. Without --eval-interval, Megatron-LM's default interval (1000) sizes valid.
    """
    gbs = args.global_batch_size
    evals = args.train_iters // (args.eval_interval or 1000) + 1
    return [args.train_iters * gbs, evals * args.eval_iters * gbs, args.eval_iters * gbs]


def gpt_dataset_config(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path), split=args.split,
        path_to_cache=args.data_cache_path, tokenizer=_null_tokenizer(NullTokenizer, args.eod_token),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.reset_attention_mask)


def _null_tokenizer(cls, eod: int):
    """Megatron-LM's NullTokenizer with EOD = `eod` and eod + 1 entries. megatron-core 0.16's
    NullTokenizer(n) is exactly that; 0.19's NullTokenizer(n) has n entries and EOD n - 1
    (tokenizers/text/libraries/null_tokenizer.py), so it is asked for the same explicitly."""
    from megatron_ucp.mcore.compat import core_version

    return cls(eod + 1, eod_id=eod) if core_version() >= (0, 19) else cls(eod)


def used_splits(config, args) -> None:
    """Build only the splits the run reads (train; valid with --eval-interval): megatron builds
    every split of --split, and one without a token loops forever looking for its epochs."""
    used = (True, bool(args.eval_interval), False)
    config.split_matrix = [m if u else None for m, u in zip(config.split_matrix, used)]


def check_splits(config, split: str) -> None:
    """Missing files and empty splits are errors on every rank, before megatron's rank-0-first
    build starts (where rank 0 would fail alone, or never finish)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in config.blend[0]:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ConfigError(f"--data-path: {prefix}{suffix} not found (a prefix names "
                                  f"{prefix}.bin and {prefix}.idx)")
        index = IndexedDataset(prefix, mmap=True)
        lengths = np.array(index.sequence_lengths)  # a copy: the view dies with the index's mmap
        del index
        for name, bookends in zip(("train", "validation"), config.split_matrix):
            if bookends is None:
                continue
            beg, end = (int(round(b * len(lengths))) for b in bookends)
            if int(np.sum(lengths[beg:end], dtype=np.int64)) == 0:
                raise ConfigError(f"--split {split!r} leaves the {name} split of {prefix} without a "
                                  f"token (it has {len(lengths)} sequences)")


def build_gpt_datasets(args):
    """(train, valid) through megatron-core's BlendedMegatronDatasetBuilder; collective.

    Every rank reads its own samples (no broadcast within TP), so every rank builds: rank 0 writes
    the index cache first, the others wait at megatron's barriers, then read the cache.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_ucp.engine.collective import run_everywhere

    config = gpt_dataset_config(args)
    used_splits(config, args)
    if torch.distributed.is_initialized():
        run_everywhere(check_splits, config, args.split)
    else:
        check_splits(config, args.split)
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, split_sizes(args), lambda: True, config).build()
    if train is None:
        raise ConfigError(f"--split {args.split!r} leaves no training data")
    if valid is None and args.eval_interval:
        raise ConfigError(f"--eval-interval needs a validation split: --split {args.split!r} has none")
    return (GPTSamples(train, args.vocab_size, "train"),
            GPTSamples(valid, args.vocab_size, "validation") if valid is not None else None)


def build_datasets(args):
    """(train, valid) datasets of a run; valid is None when it runs no validation."""
    if args.data_path:
        return build_gpt_datasets(args)
    train = build_dataset(None, args.mock_data, args.vocab_size, args.seq_length, args.seed)
    return train, OffsetSamples(train, MOCK_VALIDATION_OFFSET)


def build_dataset(data_path, mock: bool, vocab_size: int, seq_length: int, seed: int):
    """The mock dataset a run trains on; a data path goes through :func:`build_gpt_datasets`."""
    if mock and data_path:
        raise ConfigError(
            f"give either mock data or a data path, not both (data path {data_path!r})")
    if mock:
        return MockGPTDataset(vocab_size, seq_length, seed)
    if data_path:
        raise ConfigError("a data path is read by build_gpt_datasets (megatron-core's GPTDataset)")
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
    """A GPT micro-batch in Megatron's layout from samples of ``seq_length + 1`` tokens (mock) or
    GPTDataset's sample dicts."""
    if isinstance(samples[0], dict):  # GPTDataset: masks and positions come with the sample
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
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
