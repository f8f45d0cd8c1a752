"""Megatron-LM's checkpoint functions with universal checkpoints.

- `save_checkpoint`: with `--ckpt-format universal`, a universal save at the trainer's own save
  points (interval, exit interval, signal handler, exit duration, the final save); otherwise,
  and for non-persistent checkpoints (Megatron-LM's own until the local tier), megatron's code.
- `load_checkpoint`: the checkpoint that `--load` (and `--ckpt-step`) designate is loaded
  universally when it is one (its manifest says so), on any layout, whatever `--ckpt-format`
  says; a torch_dist or torch checkpoint goes to megatron's loader in its own format, so a job
  switches to universal at its next save.
- `load_args_from_checkpoint` (`--use-checkpoint-args`): a manifest's arguments.
- the padded vocabulary: the checkpoint's, before the model is built (padding rows take part in
  the softmax, so another padding is another loss).
Everything megatron's own load restores is restored: iteration, consumed / skipped / validation
samples, FLOPs so far, the micro-batch calculator, scheduler, RNG (reseeded when the layout
changed), `--finetune`, `--no-load-optim/rng`.
"""

import importlib
import inspect
import os

import torch
import torch.distributed as dist

from megatron_ucp.engine.collective import run_everywhere
from megatron_ucp.engine.local_tier import tolerating_save_failure
from megatron_ucp.format import storage, stores
from megatron_ucp.format.folder import MANIFEST, TRACKER, iteration_dir, read_tracker
from megatron_ucp.megatron_lm.flags import UNIVERSAL
from megatron_ucp.megatron_lm.patching import replace_everywhere

_ORIGINAL = {}
_PENDING = {}  # "save": the AsyncSave of a universal --async-save still writing


def _megatron(name):
    return importlib.import_module(f"megatron.training.{name}")


def _args():
    return _megatron("global_vars").get_args()


def _print(*text):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*text, flush=True)


# -- what --load designates --

def universal_target(load_dir, ckpt_step=None):
    """(iteration, folder) when `load_dir` designates a universal checkpoint, else None (no
    checkpoint, a 'release' tracker, or megatron's own formats: megatron's code handles those)."""
    if not load_dir:
        return None
    if ckpt_step is None:
        if not stores.exists(os.path.join(load_dir, TRACKER)):
            return None
        try:
            ckpt_step = read_tracker(load_dir)
        except Exception:  # 'release', or unreadable: megatron's loader says what it makes of it
            return None
    folder = iteration_dir(load_dir, ckpt_step)
    return (ckpt_step, folder) if stores.exists(os.path.join(folder, MANIFEST)) else None


def found_format(load_dir, ckpt_step=None):
    """The format of the checkpoint `load_dir` designates (universal, torch_dist, torch), or None."""
    from megatron_ucp.format.folder import found_format as folder_format

    if not load_dir:
        return None
    try:
        step = ckpt_step if ckpt_step is not None else read_tracker(load_dir)
    except Exception:
        return None
    folder = iteration_dir(load_dir, step)
    if storage.is_remote(folder):  # megatron's formats in a store: its own loader's (--enable-msc)
        return None
    return folder_format(folder)[0] if os.path.isdir(folder) else None


def require_universal(load_dir, ckpt_step=None) -> None:
    """--load-universal: what --load (and --ckpt-step) designate is a universal checkpoint, or
    nothing at all (a fresh start, as megatron's loader makes one); anything else is one line
    naming what the folder holds."""
    from megatron_ucp.errors import FormatError
    from megatron_ucp.format.folder import designated_format

    if not load_dir or (ckpt_step is None and not stores.exists(os.path.join(load_dir, TRACKER))):
        return
    step = ckpt_step if ckpt_step is not None else read_tracker(load_dir)  # 'release': its one line
    folder = iteration_dir(load_dir, step)
    found, evidence = designated_format(folder)
    raise FormatError(f"{folder}: holds a {found} checkpoint ({evidence}), not the universal one "
                      "--load-universal asks for; drop --load-universal to load it in its own format "
                      "(then --ckpt-format universal saves the next one universally), or convert it "
                      "with `megatron-ucp convert`")


def megatron_reads(args, path) -> bool:
    """Megatron-LM's own checkpoint code reaches `path`: a folder, or `msc://` under --enable-msc
    (its maybe_msc); an `s3://` path, or `msc://` without the flag, only the universal code does."""
    return not storage.is_remote(path) or (storage.scheme_of(path) == "msc" and bool(getattr(args, "enable_msc", False)))


class _Format:
    """`args.ckpt_format` set to `fmt` for a call into megatron's own code."""

    def __init__(self, args, fmt):
        self.args, self.fmt = args, fmt

    def __enter__(self):
        self.saved = self.args.ckpt_format, getattr(self.args, "use_dist_ckpt", None)
        self.args.ckpt_format = self.fmt
        if self.saved[1] is not None:
            self.args.use_dist_ckpt = self.fmt != "torch"

    def __exit__(self, *exc):
        self.args.ckpt_format = self.saved[0]
        if self.saved[1] is not None:
            self.args.use_dist_ckpt = self.saved[1]


def true_vocab_size(args) -> int:
    """The tokenizer's vocabulary (the padded one less its padding rows)."""
    try:
        return _megatron("global_vars").get_tokenizer().vocab_size
    except Exception:  # no tokenizer built (a script that builds its own): the flag
        return args.vocab_size


# -- save --

def _progress(args, flops) -> dict:
    """Megatron-LM's bookkeeping that its checkpoints keep beside the iteration."""
    return {"num_floating_point_operations_so_far": flops,
            "skipped_train_samples": getattr(args, "skipped_train_samples", 0),
            "consumed_valid_samples": getattr(args, "consumed_valid_samples", 0)}


def _rerun_pending() -> bool:
    """The rerun state machine holds a fault mid-flight (its checkpoint is per-rank state that
    only megatron's torch_dist format keeps)."""
    try:
        machine = importlib.import_module("megatron.core.rerun_state_machine")
    except ImportError:
        return False
    return machine.get_rerun_state_machine().state != machine.RerunState.NOT_RUNNING_YET


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, *rest, non_persistent_ckpt=False, **kwargs):
    args = _args()
    original = _ORIGINAL["save_checkpoint"]
    call = (iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context, *rest)
    if args.ckpt_format != UNIVERSAL:
        return original(*call, non_persistent_ckpt=non_persistent_ckpt, **kwargs)
    if non_persistent_ckpt and getattr(args, "local_ckpt_dir", None):  # the local tier (local_tier.py)
        from megatron_ucp.megatron_lm import local_tier

        return local_tier.save(args, true_vocab_size(args), iteration, model, optimizer, opt_param_scheduler,
                               _progress(args, num_floating_point_operations_so_far))
    if non_persistent_ckpt or _rerun_pending():
        if not non_persistent_ckpt:
            _print(" a re-run is pending: this checkpoint is megatron's torch_dist (it holds per-rank "
                   "fault state); the next load recognises it")
        with _Format(args, "torch_dist"):
            return original(*call, non_persistent_ckpt=non_persistent_ckpt, **kwargs)
    from megatron_ucp.api import save_universal

    finish_pending_save()
    ft = _megatron("ft_integration")  # fault tolerance's checkpoint timeouts (no-ops without it)
    ft.on_checkpointing_start()
    weights_only = args.no_save_optim  # as Megatron-LM: neither optimizer nor scheduler
    _print(f" saving universal checkpoint at iteration {iteration:7d} to {args.save}")

    def persistent():
        result = save_universal(args.save, iteration, model, None if weights_only else optimizer,
                                None if weights_only else opt_param_scheduler,
                                vocab_size=true_vocab_size(args),
                                consumed_samples=args.consumed_train_samples, args=vars(args),
                                keep_last=args.keep_last, async_save=bool(args.async_save),
                                save_rng=not args.no_save_rng,
                                progress=_progress(args, num_floating_point_operations_so_far))
        if args.async_save:
            _PENDING["save"] = result
        else:
            _print(f"  successfully saved universal checkpoint from iteration {iteration:7d} to {args.save}")

    tolerating_save_failure(args, persistent)  # with a local tier: a warning, training goes on
    ft.on_checkpointing_end(is_async_finalization=False)


def finish_pending_save(blocking: bool = True) -> None:
    """Commit a universal background save: wait for it (`blocking`), or only when every rank's
    writer is done (a flag all-reduced), as megatron finalizes its own async saves."""
    pending = _PENDING.get("save")
    if pending is None:
        return
    if not blocking:
        done = torch.tensor([1 if pending.done() else 0], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=_gloo_group())
        if not done.item():
            return
    _PENDING.pop("save")
    committed = []
    tolerating_save_failure(_args(), lambda: committed.append(pending.wait()))
    if committed:
        _print(f"  successfully saved universal checkpoint (in the background) to {committed[0]}")


def _gloo_group():
    """The group for the CPU flag of `finish_pending_save` (a gloo one beside NCCL)."""
    if "gloo" not in _PENDING:
        _PENDING["gloo"] = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return _PENDING["gloo"]


def maybe_finalize_async_save(blocking=False, *rest, **kwargs):
    finish_pending_save(blocking=blocking)
    if blocking:  # before an exit: the local tier's save in flight too
        from megatron_ucp.megatron_lm import local_tier

        local_tier.wait()
    return _ORIGINAL["maybe_finalize_async_save"](blocking, *rest, **kwargs)


# -- load --

def _reseed(args, iteration: int) -> None:
    """Megatron-LM's own seeding (initialize._set_random_seed), from --seed and the iteration,
    for a checkpoint of another layout (its per-rank RNG states belong to other ranks)."""
    fn = _megatron("initialize")._set_random_seed
    known = {"data_parallel_random_init": getattr(args, "data_parallel_random_init", False),
             "te_rng_tracker": getattr(args, "te_rng_tracker", False),
             "inference_rng_tracker": getattr(args, "inference_rng_tracker", False),
             "use_cudagraphable_rng": getattr(args, "cuda_graph_impl", "none") != "none"
             or bool(getattr(args, "enable_cuda_graph", False))}
    params = inspect.signature(fn).parameters
    fn(args.seed + iteration, **{k: v for k, v in known.items() if k in params})


def _load_universal(ddp_model, optimizer, opt_param_scheduler, load_dir, iteration):
    from megatron_ucp.api import load_universal

    args = _args()
    finetune = bool(args.finetune)
    load_optim = not (finetune or args.no_load_optim)
    result = load_universal(load_dir, ddp_model, optimizer if load_optim else None,
                            opt_param_scheduler if load_optim else None,
                            vocab_size=true_vocab_size(args), iteration=iteration,
                            load_optim=load_optim, load_scheduler=load_optim,
                            load_rng=not (finetune or args.no_load_rng),
                            strict=not args.no_strict_load, verify=not args.no_verify_checkpoint,
                            reseed=lambda it: _reseed(args, it), read_policy=args.ckpt_read_policy,
                            prove=not getattr(args, "no_resume_proof", False))
    if not load_optim and optimizer is not None:
        _main_params_from_model(args, ddp_model, optimizer)
    return _resume_from(args, result, load_dir, finetune)


def _main_params_from_model(args, ddp_model, optimizer) -> None:
    """After a load without optimizer state, the main params from the loaded weights: megatron's
    reload_model_params for 16-bit runs, and Megatron-FSDP's main-weight shards (fp32 runs keep
    them too), which megatron does not refresh (mcore/megatron_fsdp.main_from_model)."""
    from megatron_ucp.mcore import megatron_fsdp

    if any([megatron_fsdp.main_from_model(chunk) for chunk in ddp_model]):
        return
    if args.fp16 or args.bf16:
        optimizer.reload_model_params()


def _resume_from(args, result, load_dir, finetune=False):
    """Megatron-LM's bookkeeping after a load: (iteration, FLOPs so far) for the trainer."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    checkpointing = _megatron("checkpointing")
    checkpointing.set_checkpoint_version(3.0)
    if finetune:
        _print(f"  loaded universal checkpoint from {load_dir} at iteration {result.iteration} "
               "(--finetune: weights only, training starts at iteration 0)")
        return 0, 0
    progress = result.manifest.progress or {}
    args.consumed_train_samples = result.consumed_samples
    args.skipped_train_samples = int(progress.get("skipped_train_samples", 0))
    args.consumed_valid_samples = int(progress.get("consumed_valid_samples", 0))
    update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
    if hasattr(checkpointing, "set_loaded_iteration"):
        checkpointing.set_loaded_iteration(result.iteration)
    if result.iteration > 0:
        _megatron("ft_integration").on_checkpoint_loaded(is_local_chkpt=False)
    _print(f"  successfully loaded universal checkpoint from {load_dir} at iteration {result.iteration}")
    return result.iteration, progress.get("num_floating_point_operations_so_far", 0)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, *rest, **kwargs):
    args = _args()
    original = _ORIGINAL["load_checkpoint"]
    load_dir = getattr(args, load_arg)
    step = getattr(args, "ckpt_step", None)
    if getattr(args, "local_ckpt_dir", None) and load_arg == "load" and not args.finetune:
        restored = _restore_local(args, ddp_model, optimizer, opt_param_scheduler, load_dir, step)
        if restored is not None:
            return restored
    target = run_everywhere(universal_target, load_dir, step)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if target is None and pretrained and not stores.exists(os.path.join(load_dir or "", TRACKER)):
        target = run_everywhere(universal_target, pretrained)  # megatron: finetune from it
        if target is not None:
            load_dir, args.finetune = pretrained, True
    if target is not None:
        return _load_universal(ddp_model, optimizer, opt_param_scheduler, load_dir, target[0])
    if getattr(args, "load_universal", False) or (storage.is_remote(load_dir) and not megatron_reads(args, load_dir)):
        run_everywhere(require_universal, load_dir, step)  # a store megatron cannot read: universal or nothing
    fmt = run_everywhere(found_format, load_dir, step)
    if args.ckpt_format == UNIVERSAL and fmt is not None:  # megatron's format: its own loader
        with _Format(args, fmt):
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *rest, **kwargs)
    if args.ckpt_format == UNIVERSAL:
        with _Format(args, "torch_dist"):  # no checkpoint: megatron's message and its fresh start
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *rest, **kwargs)
    return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *rest, **kwargs)


def _persistent_iteration(load_dir, step) -> int:
    """The iteration --load (and --ckpt-step) designate, in any format; -1 when none."""
    if step is not None:
        return step
    try:
        return read_tracker(load_dir) if load_dir and stores.exists(os.path.join(load_dir, TRACKER)) else -1
    except Exception:  # 'release' or unreadable: megatron's loader says what it makes of it
        return -1


def _restore_local(args, ddp_model, optimizer, opt_param_scheduler, load_dir, step):
    """(iteration, FLOPs) restored from the local tier when it holds a sound iteration newer
    than --load's checkpoint, else None: the persistent tier serves."""
    from megatron_ucp.megatron_lm import local_tier

    newer_than = run_everywhere(_persistent_iteration, load_dir, step)
    result = local_tier.restore(args, true_vocab_size(args), ddp_model, optimizer, opt_param_scheduler, newer_than,
                                reseed=lambda it: _reseed(args, it))
    if result is None:
        _warn_fallback_padding(args, ddp_model, load_dir, step)
        return None
    return _resume_from(args, result, f"the local tier ({args.local_ckpt_dir})")


def _warn_fallback_padding(args, ddp_model, load_dir, step) -> None:
    """The local tier fell back: one line when the model was built with another padded
    vocabulary than the persistent checkpoint's (local_restore.fallback_padding_note)."""
    from megatron_ucp.engine import local_restore
    from megatron_ucp.format.manifest import read_manifest

    target = run_everywhere(universal_target, load_dir, step)
    if target is None:
        return
    saved = run_everywhere(lambda: read_manifest(target[1]).layout.get("padded_vocab_size"))
    note = local_restore.fallback_padding_note(ddp_model, true_vocab_size(args), saved)
    if note:
        _print(f" {note}")


def load_args_from_checkpoint(args, load_arg="load", *rest, **kwargs):
    """--use-checkpoint-args: a universal checkpoint's stored model arguments (the ones Megatron-LM
    takes from its own checkpoints), typed, bounded and checked against the manifest's
    architecture and tensors before anything is built from them (mcore/saved_args.py); read
    before the process group exists."""
    from megatron_ucp.format.manifest import read_manifest
    from megatron_ucp.mcore import saved_args
    from megatron_ucp.mcore.saved_args import CHECKPOINT_ARGS, use_checkpoint_args
    from megatron_ucp.megatron_lm.vocab import null_tokenizer_extra

    target = universal_target(getattr(args, load_arg, None), getattr(args, "ckpt_step", None))
    if target is None:
        return _ORIGINAL["load_args_from_checkpoint"](args, load_arg, *rest, **kwargs)
    manifest = read_manifest(target[1])
    path = os.path.join(target[1], MANIFEST)
    saved = manifest.args if isinstance(manifest.args, dict) else {}
    saved_args.check(saved, CHECKPOINT_ARGS, manifest, path)
    # --vocab-size as this trainer's NullTokenizer reads it; another tokenizer's vocabulary is its own
    extra = null_tokenizer_extra(args) if getattr(args, "tokenizer_type", None) == "NullTokenizer" else None
    use_checkpoint_args(args, saved, verbose=int(os.environ.get("RANK", "0")) == 0,
                        entries=manifest.architecture.get("vocab_size"), extra=extra)
    return args


def adopt_padded_vocab() -> None:
    """Before the model is built: the padded vocabulary of the checkpoint the run restores (the
    local tier's iteration when it holds one newer than --load's, as load_checkpoint takes it,
    else --load's universal checkpoint) where the new tensor-parallel size divides it
    (train.checkpointing.keep_saved_vocab_padding); where it does not, the new padding stands
    and the message names the flag."""
    from megatron_ucp.mcore.flag_validation import keeps_saved_padding

    args = _args()
    padded, source = _restored_padding(args)
    tp = args.tensor_model_parallel_size
    if not padded or padded == args.padded_vocab_size:
        return
    if keeps_saved_padding(padded, true_vocab_size(args), tp):
        _print(f" keeping {source}'s padded vocabulary of {padded} rows (instead of "
               f"{args.padded_vocab_size}): padding rows take part in the softmax")
        args.padded_vocab_size = padded
    else:
        _print(f" WARNING: {source}'s padded vocabulary of {padded} rows does not divide over "
               f"--tensor-model-parallel-size {tp}: padding to {args.padded_vocab_size} rows "
               "(--make-vocab-size-divisible-by) changes the loss")


def _restored_padding(args):
    """(padded vocabulary, where from) of the checkpoint load_checkpoint will restore, or
    (None, None). Collective."""
    from megatron_ucp.format.manifest import read_manifest

    if args.finetune:
        return None, None
    step = getattr(args, "ckpt_step", None)
    if getattr(args, "local_ckpt_dir", None) and args.load is not None:  # load_checkpoint's condition
        from megatron_ucp.engine import local_restore
        from megatron_ucp.engine.collective import on_rank_zero
        from megatron_ucp.engine.local_tier import job_identity
        from megatron_ucp.megatron_lm import local_tier

        job = on_rank_zero(job_identity, local_tier.engine_args(args, true_vocab_size(args)))  # the tier's view
        found = local_restore.peek(args.local_ckpt_dir, run_everywhere(_persistent_iteration, args.load, step), job)
        if found is not None and found[1] is not None:
            return found[1], f"local iteration {found[0]}"
    target = run_everywhere(universal_target, args.load, step)
    if target is None:
        return None, None
    return run_everywhere(lambda: read_manifest(target[1]).layout.get("padded_vocab_size")), "the checkpoint"


def _initialize_megatron(*a, **k):
    result = _ORIGINAL["initialize_megatron"](*a, **k)
    adopt_padded_vocab()
    return result


def install() -> None:
    for module in ("training", "checkpointing", "initialize", "async_utils"):
        _megatron(module)
    checkpointing, async_utils = _megatron("checkpointing"), _megatron("async_utils")
    initialize = _megatron("initialize")
    for name, module, replacement in (
            ("save_checkpoint", checkpointing, save_checkpoint),
            ("load_checkpoint", checkpointing, load_checkpoint),
            ("load_args_from_checkpoint", checkpointing, load_args_from_checkpoint),
            ("maybe_finalize_async_save", async_utils, maybe_finalize_async_save),
            ("initialize_megatron", initialize, _initialize_megatron)):
        _ORIGINAL[name] = getattr(module, name)
        replace_everywhere(_ORIGINAL[name], replacement)
