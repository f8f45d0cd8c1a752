"""The manifest `ucp.json`: what a universal checkpoint holds, self-described and versioned.

See docs/FORMAT.md. `read_manifest` validates structure before anything trusts it: every error
names the file and the key at fault.
"""

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from megatron_ucp.errors import FormatError, LayoutError
from megatron_ucp.format.folder import MANIFEST, iteration_of
from megatron_ucp.format.format_v1 import upgrade_tensors
from megatron_ucp.format import storage, stores
from megatron_ucp.format.safe_files import MAX_MANIFEST_BYTES, parse_json, read_json
from megatron_ucp.format.tensor_entry import TensorEntry

FORMAT_NAME = "megatron-ucp"
FORMAT_VERSION = 2  # 2: atomic names are megatron's checkpoint keys; 1 is read too (format_v1.py)


@dataclass(frozen=True)
class Layout:
    """The parallel layout that wrote a checkpoint: the manifest's 'layout'. A loader restores
    RNG states only on the same layout; `world_size` None (a conversion without RNG states)
    makes it reseed. `padded_vocab_size`: the vocabulary rows with their padding, when the
    model has vocabulary tensors."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    data_parallel_size: Optional[int]
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    use_distributed_optimizer: bool
    world_size: Optional[int] = None
    padded_vocab_size: Optional[int] = None
    context_parallel_size: int = 1  # absent from manifests written before it was recorded: 1

    def to_json(self) -> dict:
        out = asdict(self)
        if out["padded_vocab_size"] is None:
            del out["padded_vocab_size"]
        return out


def padded_vocab_size(entries: Dict[str, TensorEntry]) -> Optional[int]:
    """The vocabulary rows with their padding, from the tensor entries (None without any)."""
    return next((e.shape[0] + e.padding_rows for e in entries.values() if e.vocab), None)


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's `ucp.json` (docs/FORMAT.md 4). Read (`read_manifest`), every block is
    checked and the tensors are version 2's whatever `version` the file had; `args` and `source`
    are informational, kept as found. `architecture` and `layout` stay the JSON objects they
    are: the model's facts are compared key by key, and the layout with the loader's."""

    iteration: int
    consumed_samples: int
    architecture: dict
    layout: dict
    optimizer: Optional[dict]  # {"type", "step", "param_groups"[, "grad_scaler"]}; None: no optimizer state
    scheduler: Optional[dict]  # the learning-rate scheduler's state_dict(); None: none saved
    args: Any  # the saving run's arguments, JSON-safe (an object as written)
    tensors: Dict[str, TensorEntry] = field(default_factory=dict)
    rng_saved: bool = True  # False: saved without RNG states (rng/ is empty)
    progress: Optional[dict] = None  # the training loop's bookkeeping (docs/FORMAT.md 4.8)
    source: Optional[dict] = None  # where a converted checkpoint came from
    proof: Optional[dict] = None  # the resume proof (engine/proof.py; docs/FORMAT.md 4.9); None: none recorded
    version: int = FORMAT_VERSION  # the format version of the file it was read from

    def to_json(self) -> dict:
        """The manifest as this version writes it: optional blocks only when they say something."""
        out = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "iteration": self.iteration,
               "consumed_samples": self.consumed_samples, "architecture": self.architecture,
               "layout": self.layout, "optimizer": self.optimizer, "scheduler": self.scheduler,
               "args": self.args}
        if not self.rng_saved:
            out["rng_saved"] = False
        for key in ("progress", "source", "proof"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["tensors"] = {name: e.to_json() for name, e in self.tensors.items()}
        return out


def head(*, iteration: int, consumed_samples: int, architecture: dict, layout: Layout, optimizer,
         scheduler, args, rng_saved: bool = True, progress: Optional[dict] = None,
         source: Optional[dict] = None, proof: Optional[dict] = None) -> Manifest:
    """Everything in a manifest but its tensor entries, as every writer of a checkpoint (the
    save and the converters) records it; the writer adds the entries (`dataclasses.replace`)
    once its files are written."""
    return Manifest(iteration=int(iteration), consumed_samples=int(consumed_samples), architecture=architecture,
                    layout=layout.to_json(), optimizer=optimizer, scheduler=scheduler, args=jsonable(args or {}),
                    rng_saved=bool(rng_saved), progress=progress, source=source, proof=proof)


def moe_layer_pattern(config) -> Optional[list]:
    """1 for each MoE layer, 0 for each dense one (megatron's reading of `moe_layer_freq`)."""
    if not config.num_moe_experts:
        return None
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return [int(v) for v in freq]


_MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def architecture(gpt, vocab_size: int) -> dict:
    """The model facts a checkpoint must agree with to load (from megatron's TransformerConfig)."""
    c = gpt.config
    return {
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "ffn_hidden_size": c.ffn_hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_query_groups": c.num_query_groups or c.num_attention_heads,
        "kv_channels": c.kv_channels,
        "gated_linear_unit": bool(c.gated_linear_unit),
        "normalization": c.normalization,
        "add_bias_linear": bool(c.add_bias_linear),
        "num_experts": c.num_moe_experts,
        "moe_ffn_hidden_size": c.moe_ffn_hidden_size if c.num_moe_experts else None,
        "moe_layer_pattern": moe_layer_pattern(c),
        "moe_shared_expert_intermediate_size":
            c.moe_shared_expert_intermediate_size if c.num_moe_experts else None,
        "vocab_size": int(vocab_size),
        "position_embedding_type": gpt.position_embedding_type,
        "share_embeddings_and_output_weights": bool(gpt.share_embeddings_and_output_weights),
        "qk_layernorm": bool(c.qk_layernorm),
        "multi_latent_attention": bool(getattr(c, "multi_latent_attention", False)),
        **{k: (getattr(c, k, None) if getattr(c, "multi_latent_attention", False) else None) for k in _MLA_SIZES},
        "mtp_num_layers": c.mtp_num_layers or None,
    }


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a count


def _is_number(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _optional(check):
    return lambda v: v is None or check(v)


_COUNT = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
_SIZE = (lambda v: _is_int(v) and v >= 1, "an integer >= 1")
_OPTIONAL_SIZE = (_optional(_SIZE[0]), "null or an integer >= 1")
_FLAG = (lambda v: isinstance(v, bool), "true or false")
_TEXT = (lambda v: isinstance(v, str), "a string")
_NUMBER = (_is_number, "a finite number")
_PATTERN = (_optional(lambda v: isinstance(v, list) and all(_is_int(x) and x in (0, 1) for x in v)),
            "null or a list of 0 and 1")

# Every key `architecture()` writes, and what it must hold: a block lacking one cannot be
# compared with the model, so it is refused rather than skipped.
ARCHITECTURE = {
    "num_layers": _SIZE, "hidden_size": _SIZE, "ffn_hidden_size": _SIZE,
    "num_attention_heads": _SIZE, "num_query_groups": _SIZE, "kv_channels": _SIZE,
    "gated_linear_unit": _FLAG, "normalization": _TEXT, "add_bias_linear": _FLAG,
    "num_experts": _OPTIONAL_SIZE, "moe_ffn_hidden_size": _OPTIONAL_SIZE,
    "moe_layer_pattern": _PATTERN, "moe_shared_expert_intermediate_size": _OPTIONAL_SIZE,
    "vocab_size": _SIZE, "position_embedding_type": _TEXT,
    "share_embeddings_and_output_weights": _FLAG,
    "qk_layernorm": _FLAG, "multi_latent_attention": _FLAG,
    **{k: _OPTIONAL_SIZE for k in _MLA_SIZES}, "mtp_num_layers": _OPTIONAL_SIZE,
}
# Facts added after the first checkpoints were written, with the value every earlier model had.
ARCHITECTURE_SINCE = {"qk_layernorm": False, "multi_latent_attention": False,
                      **{k: None for k in _MLA_SIZES}, "mtp_num_layers": None}
# The layout that saved (save.current_layout); a converted checkpoint without RNG states
# records no world size, so that a loader reseeds, and a legacy one may not know its DP size.
LAYOUT = {
    "world_size": _OPTIONAL_SIZE, "tensor_model_parallel_size": _SIZE,
    "pipeline_model_parallel_size": _SIZE, "virtual_pipeline_model_parallel_size": _OPTIONAL_SIZE,
    "data_parallel_size": _OPTIONAL_SIZE, "expert_model_parallel_size": _SIZE,
    "expert_tensor_parallel_size": _SIZE, "use_distributed_optimizer": _FLAG,
}
# The keys megatron's OptimizerParamScheduler.load_state_dict reads, each as the names it
# accepts in the order it tries them (older Megatron-LM names first).
SCHEDULER = (
    (("start_lr", "max_lr"), _NUMBER), (("min_lr",), _NUMBER),
    (("warmup_iter", "warmup_steps", "lr_warmup_steps"), _COUNT),
    (("end_iter", "decay_steps", "lr_decay_steps"), _COUNT),
    (("decay_style", "lr_decay_style"), _TEXT), (("num_iters", "num_steps"), _COUNT),
)
# Read only when 'start_wd' is there, as megatron does.
SCHEDULER_WD = ((("start_wd",), _NUMBER), (("end_wd",), _NUMBER), (("wd_incr_steps",), _COUNT),
                (("wd_incr_style",), _TEXT))
# The fp16 loss scaler's state (optimizer_state.grad_scaler_state), when the run had one.
# megatron's DynamicGradScaler counts the hysteresis tracker down past 0 while overflows go on.
GRAD_SCALER = {"scale": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
               "growth_tracker": _COUNT,
               "hysteresis_tracker": (_is_int, "an integer")}


def _check_block(block: dict, schema: dict, path: str, where: str) -> None:
    """Every key of `schema` present in `block`, each holding what the schema says."""
    for key, (ok, expected) in schema.items():
        _need(key in block, path, f"'{where}' lacks {key!r} (expected {expected})")
        _need(ok(block[key]), path, f"'{where}.{key}' is {block[key]!r}, expected {expected}")


def check_scheduler(record, path: str) -> None:
    """A scheduler record megatron's load_state_dict can read: every key it reads, of its type."""
    _need(isinstance(record, dict), path, f"'scheduler' is {type(record).__name__}, expected an object or null")
    for names, (ok, expected) in SCHEDULER + (SCHEDULER_WD if "start_wd" in record else ()):
        found = next((n for n in names if n in record), None)
        _need(found is not None, path, f"'scheduler' lacks {names[-1]!r} (expected {expected})")
        _need(ok(record[found]), path, f"'scheduler.{found}' is {record[found]!r}, expected {expected}")


# The training loop's bookkeeping (Megatron-LM keeps it beside the iteration): all optional.
PROGRESS = {
    "num_floating_point_operations_so_far": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "skipped_iterations": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
}


def check_progress(record, path: str) -> None:
    _need(isinstance(record, dict), path, f"'progress' is {record!r}, expected an object")
    for key, (ok, expected) in PROGRESS.items():
        if key in record:
            _need(ok(record[key]), path, f"progress: {key!r} is {record[key]!r}, expected {expected}")


# The hyper-parameters of a param group a loader hands to the optimizer, when a group has them:
# the ranges torch's Adam accepts (lr, eps, weight_decay >= 0; 0 <= beta < 1), megatron's
# multipliers and scheduler bounds alike.
_RATE = (_optional(lambda v: _is_number(v) and v >= 0), "null or a finite number >= 0")
PARAM_GROUP = {
    **{k: _RATE for k in ("lr", "max_lr", "min_lr", "eps", "weight_decay", "wd_mult", "lr_mult")},
    "betas": (lambda v: isinstance(v, list) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v),
              "two numbers in [0, 1)"),
}


def check_optimizer(record, path: str) -> None:
    """The optimizer record save writes: Adam, its global step, its param groups' settings."""
    _need(isinstance(record, dict), path, f"'optimizer' is {type(record).__name__}, expected an object or null")
    _need(record.get("type") == "adam", path, f"'optimizer.type' is {record.get('type')!r}, expected 'adam'")
    _need(_COUNT[0](record.get("step")), path, f"'optimizer.step' is {record.get('step')!r}, expected {_COUNT[1]}")
    groups = record.get("param_groups")
    _need(isinstance(groups, list) and all(isinstance(g, dict) for g in groups), path,
          f"'optimizer.param_groups' is {groups!r:.80}, expected a list of objects")
    for i, group in enumerate(groups):
        for key, (ok, expected) in PARAM_GROUP.items():
            _need(key not in group or ok(group[key]), path,
                  f"'optimizer.param_groups[{i}].{key}' is {group.get(key)!r:.60}, expected {expected}")
    if record.get("grad_scaler") is not None:
        _check_block(record["grad_scaler"] if isinstance(record["grad_scaler"], dict) else {},
                     GRAD_SCALER, path, "optimizer.grad_scaler")


def check_architecture(saved: dict, current: dict, path: str) -> None:
    """Every fact of the model equal in the checkpoint; a fact the checkpoint lacks is a misfit."""
    missing = object()
    diffs = [f"{k}: checkpoint {'(none)' if saved.get(k, missing) is missing else repr(saved[k])}, model {v!r}"
             for k, v in current.items() if saved.get(k, missing) != v]
    if diffs:
        hint = vocabulary_hint(saved.get("vocab_size"), current.get("vocab_size"))
        raise LayoutError(f"{path}: checkpoint does not fit the model ({'; '.join(diffs)})" + hint)


def vocabulary_hint(saved, model) -> str:
    """Why the true vocabularies may differ, and the fix (where they do): the model's is its
    tokenizer's entries, and a NullTokenizer counts --vocab-size differently by trainer."""
    if not (isinstance(saved, int) and isinstance(model, int)) or saved == model:
        return ""
    more = saved - model
    return (f"; vocab_size counts the tokenizer's entries: give this run a --vocab-size {abs(more)} "
            f"{'larger' if more > 0 else 'smaller'} (a NullTokenizer has --vocab-size + 1 entries in "
            "pretrain_gpt_ucp.py's own loop and in Megatron-LM 0.16's trainer, --vocab-size in 0.17's and "
            "later), or --use-checkpoint-args to take it from the checkpoint")


def _words(n, bits: int):
    """A check for a list of `n` unsigned integers of `bits` bits (any non-empty list if n is None)."""
    top = 1 << bits
    return lambda v: (isinstance(v, list) and (len(v) == n if n is not None else bool(v))
                      and all(type(x) is int and 0 <= x < top for x in v))


def _real(v) -> bool:
    return type(v) in (int, float)


def rng_problems(state, torch_bytes=None, tracker=None) -> list:
    """What makes an RNG file's state unusable (rng.py restores it): (key, found, expected) each.

    `torch_bytes` and `tracker` ({name: bytes}) are the reader's own generators' sizes; None
    (the inspect tool, without torch) checks only the structure."""
    if not isinstance(state, dict):
        return [("", type(state).__name__, "an object")]
    py, npy, trk = state.get("python"), state.get("numpy"), state.get("tracker")
    names = "an object of " + (", ".join(f"{k!r}: {n} bytes" for k, n in sorted(tracker.items()))
                               if tracker is not None else "byte lists")
    checks = [
        ("python", isinstance(py, list) and len(py) == 3 and type(py[0]) is int and py[0] == 3
         and _words(625, 32)(py[1]) and py[1][-1] <= 624 and (py[2] is None or _real(py[2])),
         "[3, 625 integers < 2**32 ending in a position <= 624, null or a number]"),
        ("numpy", isinstance(npy, list) and len(npy) == 5 and npy[0] == "MT19937"
         and _words(624, 32)(npy[1]) and type(npy[2]) is int and 0 <= npy[2] <= 624
         and type(npy[3]) is int and npy[3] in (0, 1) and _real(npy[4]),
         "['MT19937', 624 integers < 2**32, a position <= 624, 0 or 1, a number]"),
        ("torch", _words(torch_bytes, 8)(state.get("torch")),
         f"{torch_bytes or 'a list of'} bytes (integers 0..255)"),
        ("cuda", state.get("cuda") is None or _words(None, 8)(state.get("cuda")), "null or a list of bytes"),
        ("tracker", isinstance(trk, dict) and (tracker is None or set(trk) == set(tracker))
         and all(_words(tracker[k] if tracker is not None else None, 8)(v) for k, v in trk.items()),
         names),
    ]
    return [(key, state.get(key), expected) for key, ok, expected in checks if not ok]


def rng_problem_message(path: str, found: tuple) -> str:
    key, value, expected = found
    shown = f"a list of {len(value)}" if isinstance(value, list) else f"{value!r:.60}"
    return f"{path}: {key!r} is {shown}, expected {expected}"


def _need(cond, path, message):
    if not cond:
        raise FormatError(f"{path}: {message}")


def read_manifest(directory: str) -> Manifest:
    """The manifest of checkpoint folder `directory`, checked as a whole before anything trusts
    it; a version-1 manifest's tensors under version 2's names."""
    path = os.path.join(directory, MANIFEST)
    what = "universal checkpoint manifest"
    if storage.is_remote(directory):  # a whole object, bounded as the file is
        m = parse_json(stores.store_for(directory).read(path, MAX_MANIFEST_BYTES, what), path, what)
    else:
        m = read_json(path, what, MAX_MANIFEST_BYTES, root=directory)
    return parse_manifest(m, path, directory)


def parse_manifest(m, path: str, directory: str) -> Manifest:
    """A manifest's JSON object (`path` names it in messages; `directory`: the folder of its
    iteration), checked as read_manifest checks it (the local tier's rank 0 piece carries one)."""
    _need(isinstance(m, dict), path, "expected a JSON object")
    _need(m.get("format") == FORMAT_NAME, path, f"'format' is {m.get('format')!r}, expected {FORMAT_NAME!r}")
    version = m.get("version")
    _need(isinstance(version, int), path, f"'version' is {version!r}, expected an integer")
    _need(version >= 1, path, f"'version' is {version}, expected 1..{FORMAT_VERSION}")
    _need(version <= FORMAT_VERSION, path,
          f"format version {version} is newer than this megatron-ucp reads ({FORMAT_VERSION}); upgrade megatron-ucp")
    for key, kind in (("iteration", int), ("consumed_samples", int), ("tensors", dict),
                      ("architecture", dict), ("layout", dict)):
        _need(isinstance(m.get(key), kind), path, f"key {key!r} missing or not {kind.__name__}")
    _check_meaning(m, path, directory)
    tensors = {name: TensorEntry.from_json(name, entry, path, version) for name, entry in m["tensors"].items()}
    if version == 1:
        try:
            tensors = upgrade_tensors(tensors)
        except ValueError as e:
            raise FormatError(f"{path}: version 1: {e}") from None
    return Manifest(iteration=m["iteration"], consumed_samples=m["consumed_samples"], architecture=m["architecture"],
                    layout=m["layout"], optimizer=m.get("optimizer"), scheduler=m.get("scheduler"),
                    args=m.get("args"), tensors=tensors, rng_saved=m.get("rng_saved", True),
                    progress=m.get("progress"), source=m.get("source"), proof=m.get("proof"), version=version)


def _check_meaning(m: dict, path: str, directory: str) -> None:
    """What the manifest says about the run agrees with itself and with its folder's name."""
    for key in ("iteration", "consumed_samples"):
        _need(_COUNT[0](m[key]), path, f"'{key}' is {m[key]!r}, expected {_COUNT[1]}")
    number = iteration_of(os.path.basename(os.path.normpath(directory)))
    _need(number is None or number == m["iteration"], path,
          f"'iteration' is {m['iteration']}, expected {number} (the number of its folder)")
    for key, value in ARCHITECTURE_SINCE.items():
        m["architecture"].setdefault(key, value)
    _check_block(m["architecture"], ARCHITECTURE, path, "architecture")
    _check_block(m["layout"], LAYOUT, path, "layout")
    if "padded_vocab_size" in m["layout"]:
        _check_block(m["layout"], {"padded_vocab_size": _SIZE}, path, "layout")
    if "context_parallel_size" in m["layout"]:
        _check_block(m["layout"], {"context_parallel_size": _SIZE}, path, "layout")
    _need(isinstance(m.get("rng_saved", True), bool), path,
          f"'rng_saved' is {m.get('rng_saved')!r}, expected true or false")
    if "progress" in m:
        check_progress(m["progress"], path)
    if m.get("optimizer") is not None:
        check_optimizer(m["optimizer"], path)
    if m.get("scheduler") is not None:
        check_scheduler(m["scheduler"], path)
    if m.get("proof") is not None:
        check_proof(m["proof"], path)


MAX_PROBE_TOKENS = 128  # the resume proof's probe sequence, at most (engine/proof.py)
MAX_PROOF_DIGESTS = 1 << 22  # a few states of a million atomic tensors


def _loss_value(v) -> bool:
    return v is None or (_is_number(v) and v >= 0)


def check_proof(record, path: str) -> None:
    """The resume proof (engine/proof.py) as save writes it: a probe the loader can rebuild
    (bounded), per-token losses, and state digests keyed 'name|state'."""
    _need(isinstance(record, dict), path, f"'proof' is {record!r:.60}, expected an object or null")
    _need(record.get("version") == 1, path, f"'proof.version' is {record.get('version')!r:.40}, expected 1")
    probe = record.get("probe")
    _need(isinstance(probe, dict), path, f"'proof.probe' is {probe!r:.60}, expected an object")
    _check_block(probe, {"seed": _COUNT, "tokens": (lambda v: _is_int(v) and 1 <= v <= MAX_PROBE_TOKENS,
                                                    f"an integer 1..{MAX_PROBE_TOKENS}"),
                         "vocab_size": _SIZE}, path, "proof.probe")
    _check_block(record, {"padded_vocab_size": _SIZE}, path, "proof")
    for key in ("dtype", "device"):
        _need(isinstance(record.get(key), str) and len(record[key]) < 32, path,
              f"'proof.{key}' is {record.get(key)!r:.40}, expected a short string")
    losses = record.get("losses")  # null: the saving machine could not run the model's forward
    _need(losses is None or isinstance(losses, list) and len(losses) == probe["tokens"]
          and all(map(_loss_value, losses)), path,
          f"'proof.losses' is {losses!r:.60}, expected {probe['tokens']} numbers >= 0 (or null)")
    dtypes = record.get("state_dtypes")
    _need(isinstance(dtypes, dict) and len(dtypes) <= 8
          and all(isinstance(k, str) and isinstance(v, str) and len(v) < 32 for k, v in dtypes.items()), path,
          f"'proof.state_dtypes' is {dtypes!r:.60}, expected an object of dtype names")
    digests = record.get("digests")
    _need(isinstance(digests, dict) and len(digests) <= MAX_PROOF_DIGESTS, path,
          f"'proof.digests' is {digests!r:.60}, expected an object of 'name|state': [digest, scale]")
    for key, value in digests.items():
        _need("|" in key and isinstance(value, list) and len(value) == 2
              and all(v is None or _is_number(v) for v in value), path,
              f"'proof.digests' holds {key!r:.60}: {value!r:.60}, expected [a number, a number]")


MAX_JSON_DEPTH = 64  # the manifest's own blocks nest 4 deep; arguments hold a list or two


def json_problem(obj, where: str = "") -> Optional[str]:
    """Why `obj` is not strict JSON a reader takes (a NaN or infinity, a non-string key, a value
    JSON has no type for, nesting past MAX_JSON_DEPTH), naming the first such key; else None."""
    todo = [(obj, where, 0)]
    while todo:
        value, key, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            return f"{key!r:.80} nests deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key!r:.80} is {value}, expected a finite number (JSON has no NaN or infinity)"
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    return f"{key!r:.80} has the key {k!r:.40}, expected a string"
                todo.append((v, f"{key}.{k}" if key else k, depth + 1))
        elif isinstance(value, (list, tuple)):
            todo.extend((v, f"{key}[{i}]", depth + 1) for i, v in enumerate(value))
        elif not (value is None or isinstance(value, (str, int, float))):
            return f"{key!r:.80} is a {type(value).__name__}, expected a JSON value"
    return None


def check_written(head: "Manifest", directory: str) -> None:
    """What a writer is about to commit as `directory`'s manifest passes what read_manifest (and
    so `inspect --verify`) checks, tensors aside: nothing invalid is written."""
    import copy

    path = os.path.join(directory, MANIFEST)
    m = head.to_json()
    problem = json_problem(m)
    _need(problem is None, path, f"would be written with {problem}")
    _check_meaning(copy.deepcopy(m), path, directory)


def jsonable(obj):
    """Arguments made JSON-safe: string keys, lists for tuples, repr() for anything else."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return repr(obj)
