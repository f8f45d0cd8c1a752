"""Megatron-LM's pickled training arguments, read without Megatron-LM's classes.

Megatron-LM saves `args` as an `argparse.Namespace` whose values include a few enums of its
own (`AttnBackend`, `ModelType`, `InferenceCudaGraphScope`) and `signal.Signals`. Unpickling
them would import and call megatron's code from a stranger's file, so each is read into an
inert stand-in that keeps the pickle's arguments as data (safe_pickle's `stand_ins`); the
arguments come out as a plain dict of JSON-able values, enums as `<Class value>` text, which
no model flag reads.
"""

import argparse
import enum

# The classes Megatron-LM 0.19's args name besides argparse.Namespace and torch dtypes.
ENUM_NAMES = ("megatron.core.transformer.enums.AttnBackend",
              "megatron.core.transformer.enums.InferenceCudaGraphScope",
              "megatron.core.transformer.enums.AttnMaskType",
              "megatron.core.enums.ModelType",
              "signal.Signals")


class EnumValue:
    """An inert stand-in for one enum member: the value its pickle constructs it from."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):  # an enum pickles by value; any state is kept, not run
        self.state = state

    def text(self) -> str:
        return f"<{type(self).__name__} {self.args[0] if len(self.args) == 1 else list(self.args)!r}>"


def _stand_in(qualified: str):
    """A stand-in class per enum name, so the text says which enum the value belonged to."""
    return type(qualified.rsplit(".", 1)[1], (EnumValue,), {})


STAND_INS = [(_stand_in(name), name) for name in ENUM_NAMES]


MAX_DEPTH = 16  # Megatron-LM's arguments hold flat lists (data paths, a layer pattern)


class _TooDeep(Exception):
    pass


def plain(value, depth: int = 0):
    """A stored argument as JSON-able data: dtypes and stand-ins as their text."""
    if depth > MAX_DEPTH:
        raise _TooDeep()
    if isinstance(value, EnumValue):
        return value.text()
    if isinstance(value, enum.Enum):  # megatron's own class, where torch's allowlist let it through
        return f"<{type(value).__name__} {value.value!r}>"
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def plain_args(stored, where: str) -> dict:
    """The arguments a checkpoint stores (a Namespace, or a dict) as a plain dict; a value
    nested deeper than MAX_DEPTH is refused (a stranger's pickle can nest a list 10**5 deep)."""
    from megatron_ucp.errors import FormatError

    if isinstance(stored, argparse.Namespace):
        stored = vars(stored)
    if not isinstance(stored, dict):
        raise FormatError(f"{where}: holds {type(stored).__name__}, expected the training arguments "
                          "(an argparse Namespace)")
    out = {}
    for k, v in stored.items():
        try:
            out[str(k)] = plain(v)
        except _TooDeep:
            raise FormatError(f"{where}: 'args.{k}' nests deeper than {MAX_DEPTH} levels; expected a "
                              "plain value or a flat list") from None
    return out
