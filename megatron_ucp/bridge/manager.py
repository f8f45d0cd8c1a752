"""Universal checkpoints for Megatron-Bridge through its `CheckpointManager` hook
(megatron-bridge 0.6.2 training/checkpointing.py:604; `CheckpointConfig.custom_manager_class`).

- `save`: at every persistent save point Bridge calls (interval, exit conditions, signals, the
  final save) a universal checkpoint of the model, optimizer, scheduler and RNG, with Bridge's
  train state (step, consumed / skipped / validation samples, FLOPs) in the manifest's progress;
  Bridge's side files beside it (run_config.yaml, train_state.pt, latest_train_state.pt, the
  tokenizer's assets when asked). Non-persistent saves are Bridge's own.
- `load`: the checkpoint `load` (or `ckpt_step`, or an `iter_N` folder named directly, or
  `pretrained_checkpoint` for a fine-tune) designates is loaded universally when it is one, on
  any layout, and Bridge's `state.train_state` restored from it; any other format goes to
  Bridge's default manager, so a torch_dist run continues as universal at its next save.
- `finalize_async_saves`: a universal async save is committed where Bridge finalizes its own.
The engine calls are the ones Megatron-LM's plug-in makes (megatron_lm/checkpoint.py).
"""

import os
import re

import torch
import torch.distributed as dist

from megatron_ucp.engine.collective import run_everywhere
from megatron_ucp.format.folder import MANIFEST, iteration_dir
from megatron_ucp.megatron_lm.checkpoint import universal_target

_ITERATION_FOLDER = re.compile(r"iter_(\d+)$")


def _print(*text):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*text, flush=True)


def designated(load_dir, ckpt_step=None):
    """(folder holding the tracker, iteration) of the universal checkpoint `load_dir` designates
    (a checkpoint folder with its tracker, with `ckpt_step`, or an iter_N folder itself), else None."""
    if not load_dir:
        return None
    match = _ITERATION_FOLDER.search(os.path.basename(os.path.normpath(load_dir)))
    if match and os.path.lexists(os.path.join(load_dir, MANIFEST)):
        return os.path.dirname(os.path.normpath(load_dir)), int(match.group(1))
    target = universal_target(load_dir, ckpt_step)
    return (load_dir, target[0]) if target is not None else None


def _bridge(name):
    import importlib

    return importlib.import_module(f"megatron.bridge.{name}")


class UniversalCheckpointManager:
    """A `CheckpointManager` (Bridge's protocol) that saves universal checkpoints and loads any
    universal checkpoint on any layout; Bridge's own formats go to its default manager."""

    def __init__(self, checkpoint_config):
        self.checkpoint_config = checkpoint_config
        self.default = _bridge("training.checkpointing").DefaultCheckpointManager(checkpoint_config)
        self._pending = None  # (AsyncSave, state, step, flops, callback_manager, model, optimizer)
        self._gloo = None

    @property
    def checkpointing_context(self):
        """The default manager's context: Bridge asks it for a local (non-persistent) checkpoint."""
        return self.default.checkpointing_context

    # -- save --

    def save(self, ctx, callback_manager=None) -> None:
        if ctx.non_persistent_ckpt:  # Bridge's local / global non-persistent checkpoints
            return self.default.save(ctx, callback_manager)
        from megatron_ucp.api import save_universal

        state, cfg = ctx.state, self.checkpoint_config
        fault_tolerance = _bridge("training.fault_tolerance")
        self.finalize_async_saves(state, blocking=True)
        fault_tolerance.on_checkpointing_start(state)
        train_state = state.train_state
        step, flops = train_state.step, ctx.num_floating_point_operations_so_far
        weights_only = not cfg.save_optim  # as Bridge: neither optimizer nor scheduler
        _print(f" saving universal checkpoint at iteration {step:7d} to {cfg.save}")
        result = save_universal(
            cfg.save, step, ctx.model, None if weights_only else ctx.optimizer,
            None if weights_only else ctx.opt_param_scheduler, vocab_size=true_vocab_size(state),
            consumed_samples=train_state.consumed_train_samples,
            keep_last=cfg.most_recent_k if cfg.most_recent_k and cfg.most_recent_k > 0 else None,
            async_save=bool(cfg.async_save), save_rng=cfg.save_rng, progress=_progress(train_state, flops))
        # Bridge's train state as of this save: an async save commits iterations later
        snapshot = {k: v.clone() for k, v in train_state.state_dict().items()}
        pending = (result, state, step, snapshot, flops, callback_manager, ctx.model, ctx.optimizer)
        if cfg.async_save:
            self._pending = pending
        else:
            self._committed(*pending[1:])
        fault_tolerance.on_checkpointing_end(is_async_finalization=False, global_state=state)

    def _committed(self, state, step, train_state, flops, callback_manager, model, optimizer) -> None:
        """After the commit: Bridge's side files (rank 0), a barrier, its save callback."""
        if dist.get_rank() == 0:
            write_side_files(state, self.checkpoint_config.save, step, train_state, flops)
        dist.barrier()
        _print(f"  successfully saved universal checkpoint from iteration {step:7d} to "
               f"{self.checkpoint_config.save}")
        callbacks = _bridge("training.callbacks")
        if callbacks.should_fire(callback_manager, "on_checkpoint_save"):
            callback_manager.fire("on_checkpoint_save", callbacks.CallbackContext(
                state=state, model=model, user_state=callback_manager.user_state, optimizer=optimizer))

    def finalize_async_saves(self, state, blocking: bool = False, terminate: bool = False) -> None:
        """Commit a universal background save: wait for it (`blocking`), or only once every rank's
        writer is done (a flag all-reduced, as Bridge polls its own); then Bridge's own queue."""
        if self._pending is not None:
            result = self._pending[0]
            done = blocking
            if not blocking:
                flag = torch.tensor([1 if result.done() else 0], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._gloo_group())
                done = bool(flag.item())
            if done:
                pending, self._pending = self._pending, None
                pending[0].wait()
                self._committed(*pending[1:])
        self.default.finalize_async_saves(state, blocking=blocking, terminate=terminate)

    def _gloo_group(self):
        if self._gloo is None:
            self._gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else False
        return self._gloo or None

    # -- load --

    def load(self, ctx):
        state, cfg = ctx.state, self.checkpoint_config
        target = run_everywhere(designated, cfg.load, cfg.ckpt_step)
        finetune = bool(cfg.finetune)
        if target is None and cfg.pretrained_checkpoint and not run_everywhere(
                _bridge("training.utils.checkpoint_utils").checkpoint_exists, cfg.load):
            target = run_everywhere(designated, cfg.pretrained_checkpoint)
            if target is not None:  # Bridge's rule: fine-tune from the pretrained checkpoint
                _print(f" no checkpoint in {cfg.load}: fine-tuning from {cfg.pretrained_checkpoint}")
                cfg.finetune = finetune = True
        if target is None:  # torch_dist, fsdp_dtensor, a local checkpoint: Bridge's own loader
            return self.default.load(ctx)
        if ctx.skip_load_to_model_and_opt:
            from megatron_ucp.errors import ConfigError

            raise ConfigError(f"{target[0]}: a universal checkpoint with dist.use_torch_fsdp2 in "
                              "Megatron-Bridge is not supported (Bridge loads FSDP2 weights itself)")
        return self._load_universal(ctx, state, cfg, target, finetune)

    def _load_universal(self, ctx, state, cfg, target, finetune):
        from megatron_ucp.api import load_universal

        load_dir, iteration = target
        load_optim = bool(cfg.load_optim) and not finetune
        result = load_universal(
            load_dir, ctx.model, ctx.optimizer if load_optim else None,
            ctx.opt_param_scheduler if load_optim else None, vocab_size=true_vocab_size(state),
            iteration=iteration, load_optim=load_optim, load_scheduler=load_optim,
            load_rng=bool(cfg.load_rng) and not finetune, strict=ctx.strict,
            reseed=lambda it: _reseed(state, ctx, it))
        if not load_optim and ctx.optimizer is not None:
            _main_params_from_model(state, ctx.model, ctx.optimizer)
        _warn_other_padding(ctx.model, result.manifest.layout.get("padded_vocab_size"))
        return _resume_from(state, result, load_dir, finetune)

    def __repr__(self):
        return f"UniversalCheckpointManager(save={self.checkpoint_config.save!r}, load={self.checkpoint_config.load!r})"


# -- Bridge's bookkeeping --

def true_vocab_size(state) -> int:
    """The model's unpadded vocabulary (setup.py sets cfg.model.vocab_size from the tokenizer)."""
    return int(state.cfg.model.vocab_size)


def _progress(train_state, flops) -> dict:
    return {"num_floating_point_operations_so_far": flops,
            "skipped_train_samples": int(train_state.skipped_train_samples),
            "consumed_valid_samples": int(train_state.consumed_valid_samples)}


def write_side_files(state, save_dir, step, train_state: dict, flops) -> None:
    """Bridge's files beside a committed checkpoint (checkpointing.py:1432-1474): its train state
    as of the save (`train_state`: TrainState.state_dict() then) in the iteration folder and as
    `latest_train_state.pt` (the tracker Bridge reads first, so Bridge's tools and a later default
    manager see this step), the run's config, the tokenizer."""
    checkpointing = _bridge("training.checkpointing")
    utils = _bridge("training.utils.checkpoint_utils")
    folder = iteration_dir(save_dir, step)
    train_state = dict(train_state)
    train_state["floating_point_operations_so_far"] = torch.tensor(flops, dtype=torch.float32)
    local = utils.get_checkpoint_train_state_filename(folder)
    torch.save(train_state, local)
    latest = utils.get_checkpoint_train_state_filename(save_dir, prefix=utils.TRACKER_PREFIX)
    torch.save(train_state, latest + ".tmp")
    os.replace(latest + ".tmp", latest)
    state.cfg.to_yaml(utils.get_checkpoint_run_config_filename(folder))
    if state.cfg.checkpoint.save_tokenizer_assets:
        tokenizer = getattr(state.cfg.dataset, "tokenizer", None) if state.cfg.dataset else None
        if tokenizer is not None:
            checkpointing.save_tokenizer_assets(tokenizer, state.cfg.tokenizer, folder)


def _reseed(state, ctx, iteration: int) -> None:
    """Bridge's own seeding (initialize._set_random_seed), from rng.seed and the iteration, for
    a checkpoint of another layout (its per-rank RNG states belong to other ranks)."""
    initialize = _bridge("training.initialize")
    rng = state.cfg.rng
    pg_collection = ctx.pg_collection or _bridge("training.utils.pg_utils").get_pg_collection(ctx.model)
    initialize._set_random_seed(rng.seed + iteration, rng.data_parallel_random_init, rng.te_rng_tracker,
                                rng.inference_rng_tracker,
                                use_cudagraphable_rng=getattr(state.cfg.model, "cuda_graph_impl", "none") != "none",
                                pg_collection=pg_collection)


def _warn_other_padding(model, saved) -> None:
    """Bridge builds the model before any manager runs, so it cannot take the checkpoint's padded
    vocabulary as Megatron-LM's plug-in does (checkpoint.adopt_padded_vocab): one line when they
    differ, naming the setting (padding rows take part in the softmax: another loss)."""
    from megatron_ucp.mcore.model_map import padded_vocab

    built = run_everywhere(padded_vocab, model)
    if saved and built and saved != built:
        _print(f" WARNING: the checkpoint's padded vocabulary has {saved} rows, this model {built}: padding "
               "rows take part in the softmax, so the loss changes (set model.make_vocab_size_divisible_by, "
               "and model.vocab_size to None for the tokenizer's vocabulary padded, to build the same)")


def _main_params_from_model(state, model, optimizer) -> None:
    """After a load without optimizer state, the main params from the loaded weights (16-bit runs
    keep fp32 copies the optimizer steps; fp32 runs step the weights themselves)."""
    from megatron_ucp.mcore import megatron_fsdp

    if any([megatron_fsdp.main_from_model(chunk) for chunk in model]):
        return
    if getattr(state.cfg.model, "fp16", False) or getattr(state.cfg.model, "bf16", False):
        optimizer.reload_model_params()


def _resume_from(state, result, load_dir, finetune):
    """Bridge's train state after a load (checkpointing.py:2979-3007): (iteration, FLOPs)."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    checkpointing = _bridge("training.checkpointing")
    checkpointing.set_checkpoint_version(3.0)
    if finetune:
        state.train_state.step = 0
        _print(f"  loaded universal checkpoint from {load_dir} at iteration {result.iteration} "
               "(finetune: weights only, training starts at iteration 0)")
        return 0, 0
    progress = result.manifest.progress or {}
    train_state = state.train_state
    train_state.step = result.iteration
    train_state.consumed_train_samples = int(result.consumed_samples)
    train_state.skipped_train_samples = int(progress.get("skipped_train_samples", 0))
    train_state.consumed_valid_samples = int(progress.get("consumed_valid_samples", 0))
    train_state.floating_point_operations_so_far = progress.get("num_floating_point_operations_so_far", 0)
    update_num_microbatches(consumed_samples=train_state.consumed_train_samples, verbose=True)
    if result.iteration > 0:
        _bridge("training.fault_tolerance").on_checkpoint_loaded(is_local_chkpt=False, global_state=state)
    _print(f"  successfully loaded universal checkpoint from {load_dir} at iteration {result.iteration}")
    return train_state.step, train_state.floating_point_operations_so_far
