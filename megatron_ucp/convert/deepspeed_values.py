"""The values a DeepSpeed universal checkpoint stores, read as typed and bounded data.

Everything in `mp_rank_*_model_states.pt`, `zero/optimizer_state.pt` and `step.pt` is input from
strangers: a size may be text, inf or NaN, a record may nest a thousand levels deep or be
another type altogether. Each value the import uses (or writes into ucp.json) passes one of
these readers, which return the plain value or raise one error naming the file, the key and
what was expected; nothing negative, non-finite or unbounded reaches the output.

Pure functions: no I/O, no torch (deepspeed.py unwraps tensors first).
"""

import enum
import math

from megatron_ucp.convert.megatron_args import EnumValue
from megatron_ucp.errors import ConfigError, FormatError

MAX_DEPTH = 16  # Megatron-DeepSpeed's args nest two levels (lists of numbers); records a few more
MAX_COUNT = 2**62  # steps, samples, sizes: JSON integers every reader keeps exact
MAX_PARALLEL = 2**20  # TP, PP, DP degrees


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def whole(value, where: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """An integer in [lo, hi] (a bool, a float, text: refused)."""
    if not _is_int(value) or not lo <= value <= hi:
        raise FormatError(f"{where} is {_short(value)}, expected an integer in [{lo}, {hi}]")
    return value


def real(value, where: str, lo: float = None, hi: float = None, above: float = None) -> float:
    """A finite number (int or float) >= lo, <= hi, > above."""
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi) and (above is None or value > above)
    if not ok:
        bounds = [f">= {lo}"] * (lo is not None) + [f"<= {hi}"] * (hi is not None) \
            + [f"> {above}"] * (above is not None)
        raise FormatError(f"{where} is {_short(value)}, expected a finite number"
                          + (f" {' and '.join(bounds)}" if bounds else ""))
    return float(value)


def flag(value, where: str, default: bool) -> bool:
    """A switch: true/false (0/1 as argparse's store_true never gives, but JSON-ish writers do)."""
    if value is None:
        return default
    if isinstance(value, bool) or (_is_int(value) and value in (0, 1)):
        return bool(value)
    raise FormatError(f"{where} is {_short(value)}, expected true or false")


def _short(value) -> str:
    """A value for a message: its repr cut short (never a recursion into a deep record)."""
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def plain(value, where: str, depth: int = 0, named=None):
    """A stored value as JSON data: numbers finite (inf and NaN become their text), enums and
    unknown objects as text, containers at most MAX_DEPTH deep (deeper: refused). `named`:
    a function giving a stand-in's text, or None (its class and value)."""
    if depth > MAX_DEPTH:
        raise FormatError(f"{where}: nested deeper than {MAX_DEPTH} levels; not a training argument or record")
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no inf or NaN: kept as text, which no reader takes for a number
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if named is not None:
        text = named(value)
        if text is not None:
            return text
    if isinstance(value, EnumValue):
        return value.text()
    if isinstance(value, enum.Enum):  # the real class, where megatron was imported and allowed it
        return f"<{type(value).__name__} {plain(value.value, where, depth + 1)!r}>"
    if isinstance(value, (list, tuple)):
        return [plain(v, where, depth + 1, named) for v in value]
    if isinstance(value, dict):
        return {str(plain(k, where, depth + 1, named)): plain(v, where, depth + 1, named) for k, v in value.items()}
    return f"<{type(value).__name__}>"


# ---- the scheduler --------------------------------------------------------------------------------

# Megatron-DeepSpeed's OptimizerParamScheduler.state_dict(), older names mapped to the new.
_OLD_SCHEDULER_NAMES = {"start_lr": "max_lr", "warmup_iter": "lr_warmup_steps", "warmup_steps": "lr_warmup_steps",
                        "end_iter": "lr_decay_steps", "decay_steps": "lr_decay_steps",
                        "decay_style": "lr_decay_style", "num_iters": "num_steps",
                        "warmup_tokens": "lr_warmup_tokens", "decay_tokens": "lr_decay_tokens"}
_TOKENS = ("lr_warmup_tokens", "lr_decay_tokens")  # megatron-core's scheduler (0.16, 0.19) has no tokens
_COUNTS = ("lr_warmup_steps", "lr_decay_steps", "num_steps", "wd_incr_steps")
_RATES = ("max_lr", "min_lr", "start_wd", "end_wd")
_STYLES = {"lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
           "wd_incr_style": ("constant", "linear", "cosine")}
_WD = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


def scheduler(record, path: str) -> dict:
    """The saved scheduler as megatron-core's reads it: the step-based keys only, each checked
    (counts >= 0, rates finite >= 0, min_lr <= max_lr, a known style). A token-based schedule
    is refused: megatron-core counts steps, and its flags would give another curve."""
    if not isinstance(record, dict):
        raise FormatError(f"{path}: lr_scheduler is {_short(record)}, expected a dict (the scheduler's state_dict)")
    s = {_OLD_SCHEDULER_NAMES.get(k, k): v for k, v in record.items() if isinstance(k, str)}
    tokens = [k for k in _TOKENS if s.get(k) is not None]
    if tokens:
        raise ConfigError(f"{path}: a token-based learning-rate schedule (lr_scheduler {', '.join(tokens)}); "
                          "megatron-core's scheduler counts steps only, so no flags resume it: not imported")
    out = {}
    for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps") + \
            (_WD if "start_wd" in s else ()):
        if key not in s:
            raise FormatError(f"{path}: lr_scheduler lacks {key!r}")
        where = f"{path}: lr_scheduler.{key}"
        if key in _COUNTS:
            out[key] = whole(s[key], where)
        elif key in _RATES:
            out[key] = real(s[key], where, lo=0.0)
        elif s[key] not in _STYLES[key]:
            raise FormatError(f"{where} is {_short(s[key])}, expected one of {', '.join(_STYLES[key])}")
        else:
            out[key] = s[key]
    if out["min_lr"] > out["max_lr"]:
        raise FormatError(f"{path}: lr_scheduler.min_lr {out['min_lr']} is above max_lr {out['max_lr']}")
    if out["lr_warmup_steps"] > out["lr_decay_steps"]:
        raise FormatError(f"{path}: lr_scheduler.lr_warmup_steps {out['lr_warmup_steps']} is past "
                          f"lr_decay_steps {out['lr_decay_steps']}")
    return out


# ---- the optimizer --------------------------------------------------------------------------------

def adam_group(group: dict, path: str, index: int) -> dict:
    """One param group's hyper-parameters as JSON values (`params` and `step` aside), Adam's
    checked: betas two numbers in [0, 1), eps > 0, lr and weight decay >= 0, all finite."""
    where = f"{path}: param_groups[{index}]"
    out = {}
    for key, value in group.items():
        if key in ("params", "step") or not isinstance(key, str):
            continue
        if isinstance(value, (int, float, str, bool, type(None))):  # as plain_groups keeps them
            out[key] = plain(value, f"{where}.{key}")
    betas = group.get("betas")
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise FormatError(f"{where}.betas is {_short(betas)}, expected two numbers")
    out["betas"] = [real(b, f"{where}.betas[{i}]", lo=0.0, hi=1.0) for i, b in enumerate(betas)]
    if out["betas"][1] >= 1.0 or out["betas"][0] >= 1.0:
        raise FormatError(f"{where}.betas is {out['betas']}, expected numbers below 1")
    out["eps"] = real(group.get("eps"), f"{where}.eps", above=0.0)
    for key in ("lr", "weight_decay", "initial_lr", "wd_mult", "lr_mult"):
        if key in group:
            out[key] = real(group[key], f"{where}.{key}", lo=0.0)
    return out


def step_count(value, path: str) -> int:
    """Adam's step from a step.pt (a number, or a one-element tensor's item): a whole number >= 0."""
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and 0 <= value <= MAX_COUNT
    if not ok or value != int(value):
        raise FormatError(f"{path}: step {_short(value)}, expected a whole number >= 0")
    return int(value)


# ---- DeepSpeed's records of the saving run --------------------------------------------------------

def parallel_degrees(states: dict, args: dict, path: str) -> tuple:
    """(tp, pp, dp) of the saving run: DeepSpeed's `checkpoint_parallel_dimensions`, else the
    args; dp is None where DeepSpeed did not record it."""
    dims = states.get("checkpoint_parallel_dimensions")
    if dims is None:
        dims = {}
    if not isinstance(dims, dict):
        raise FormatError(f"{path}: checkpoint_parallel_dimensions is {_short(dims)}, expected a dict")
    tp = dims.get("tp_degree", args.get("tensor_model_parallel_size", 1))
    pp = dims.get("pp_degree", args.get("pipeline_model_parallel_size", 1))
    tp = whole(tp, f"{path}: the TP degree (checkpoint_parallel_dimensions.tp_degree)", 1, MAX_PARALLEL)
    pp = whole(pp, f"{path}: the PP degree (checkpoint_parallel_dimensions.pp_degree)", 1, MAX_PARALLEL)
    dp = states.get("dp_world_size")
    dp = None if dp is None else whole(dp, f"{path}: dp_world_size", 1, MAX_PARALLEL)
    return tp, pp, dp


def zero_stage(config, path: str):
    """The ZeRO stage of DeepSpeed's `ds_config` (0-3), or None where it does not say (an older
    DeepSpeed may have kept the config file's path there)."""
    if config is None or isinstance(config, str):
        return None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: ds_config is {_short(config)}, expected DeepSpeed's config dict")
    zero = config.get("zero_optimization")
    if zero is None:
        return None
    if not isinstance(zero, dict):
        raise FormatError(f"{path}: ds_config.zero_optimization is {_short(zero)}, expected a dict")
    stage = zero.get("stage")
    return None if stage is None else whole(stage, f"{path}: ds_config.zero_optimization.stage", 0, 3)


def version_text(value, path: str) -> str:
    """DeepSpeed's `ds_version`: a short string (anything else recorded as its type)."""
    if isinstance(value, str) and len(value) <= 64:
        return value
    return "unknown" if value is None else f"<{type(value).__name__}>"


def vocab_rows(param_shapes, names: dict, path: str) -> dict:
    """{DeepSpeed name: rows on each TP rank} for the vocabulary parameters `names` lists,
    from DeepSpeed's `param_shapes` (a list per param group of {name: shape}), where recorded."""
    if param_shapes is None:
        return {}
    if not isinstance(param_shapes, (list, tuple)):
        raise FormatError(f"{path}: param_shapes is {_short(param_shapes)}, expected a list of dicts")
    rows = {}
    for i, group in enumerate(param_shapes):
        if not isinstance(group, dict):
            raise FormatError(f"{path}: param_shapes[{i}] is {_short(group)}, expected a dict of shapes")
        for name, shape in group.items():
            if name not in names:
                continue
            if not isinstance(shape, (list, tuple)) or not shape or not all(_is_int(d) and 0 <= d <= MAX_COUNT
                                                                             for d in shape):
                raise FormatError(f"{path}: param_shapes[{i}][{name!r}] is {_short(shape)}, expected a shape "
                                  "(a list of integers >= 0)")
            rows[name] = shape[0]
    return rows


MAX_PADDING = 8192  # rows: make_vocab_size_divisible_by x TP of real runs (128 x 64) stays below


def padded_vocab(original: int, padded: int, divisible, tp: int, where: str) -> None:
    """The padded vocabulary is what Megatron-DeepSpeed's tokenizer makes of the true one
    (`_vocab_size_with_padding`): the smallest multiple of make_vocab_size_divisible_by x TP at
    or above it; and its padding rows, written as zeros, are at most the true vocabulary's
    count or MAX_PADDING. Anything else is refused before a byte is written."""
    divisible = 128 if divisible is None else divisible  # Megatron-DeepSpeed's default
    multiple = divisible * tp
    want = -(-original // multiple) * multiple
    if padded != want:
        raise FormatError(f"{where}: padded_vocab_size {padded} for a vocabulary of {original}; Megatron-DeepSpeed "
                          f"pads it to a multiple of make_vocab_size_divisible_by {divisible} x TP {tp}: {want}")
    if padded - original > max(original, MAX_PADDING):
        raise FormatError(f"{where}: padded_vocab_size {padded} adds {padded - original} padding rows to a vocabulary "
                          f"of {original} (make_vocab_size_divisible_by {divisible} x TP {tp}); at most "
                          f"{max(original, MAX_PADDING)} are accepted")
