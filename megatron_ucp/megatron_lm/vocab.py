"""What `--vocab-size` means to the trainer's NullTokenizer, asked of the trainer itself.

Megatron-LM's NullTokenizer has `--vocab-size` + 1 entries (an EOD after the tokens) in its 0.16
trainer (megatron/training/tokenizer/tokenizer.py, `_NullTokenizer`), as in the project's own
loop, but `--vocab-size` entries in 0.17 and later (megatron/core/tokenizers, EOD the last id).
A checkpoint stores its true vocabulary (the model's rows less padding); the flag that rebuilds
it depends on the trainer that reads it. The answer comes from building the trainer's own
NullTokenizer, not from a version number: a clone's trainer of any release answers for itself.
"""

import argparse
import contextlib
import importlib
import io

_PROBE = 17  # any size: only the difference between entries and flag matters


def null_tokenizer_extra(args=None) -> int:
    """The entries the trainer's NullTokenizer adds to `--vocab-size` (1 or 0)."""
    builder = importlib.import_module("megatron.training.global_vars").build_tokenizer
    probe = argparse.Namespace(**vars(args or argparse.Namespace()))
    probe.__dict__.update(tokenizer_type="NullTokenizer", vocab_size=_PROBE, padded_vocab_size=_PROBE,
                          pad_vocab_size=False, rank=0, null_tokenizer_eod_id=None)
    with contextlib.redirect_stdout(io.StringIO()):  # 0.16's builder prints what it builds
        return builder(probe).vocab_size - _PROBE


def flag_for(entries: int, args) -> int:
    """The `--vocab-size` that gives the trainer's NullTokenizer `entries` entries."""
    return entries - null_tokenizer_extra(args)
