"""Replacing one of megatron's functions wherever the trainer's modules hold it."""

import sys


def replace_everywhere(original, replacement) -> int:
    """Bind `replacement` in every loaded megatron module that holds `original` by name
    (training.py imports the checkpoint functions by name, so patching checkpointing.py alone
    would miss its calls); returns how many bindings changed."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            if value is original:
                setattr(module, attribute, replacement)
                count += 1
    return count
