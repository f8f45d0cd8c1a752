"""The GPT pretraining loop: initialise the process groups, build, resume, train, save.

`pretrain(argv)` can run several times in one process (the tests do): every call builds its
own model-parallel state and tears it down at the end.
"""

import contextlib
import json
import os
import random
import time
from datetime import timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                       init_num_microbatches_calculator)
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ucp.engine import collective
from megatron_ucp.mcore import compat
from megatron_ucp.mcore.flag_validation import validate
from megatron_ucp.mcore.flags import build_parser
from megatron_ucp.mcore.model import build_train_state, release_train_state
from megatron_ucp.train import checkpointing, progress
from megatron_ucp.train.data import build_datasets, microbatches
from megatron_ucp.train.monitor import Monitor


def init_distributed(cpu: bool, timeout_minutes: float = 10.0) -> None:
    """Join the torchrun process group (or a single-process one when run bare).

    `timeout_minutes` bounds every collective: when a peer dies mid-collective, the survivors
    fail after at most this long (then torchrun restarts them, see docs/elastic.md).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend="gloo" if cpu else "nccl",
                            timeout=timedelta(minutes=timeout_minutes))


def set_seeds(seed: int) -> None:
    """Megatron-LM's seeding: a different stream per pipeline stage, named streams for TP/EP."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize(args) -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(
        dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size,
    )
    set_seeds(args.seed)


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # clone: the schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    # loss_mask: megatron masks the MTP losses with it (the main loss is masked in _loss_func).
    # attention_mask: None (causal) unless --reset-attention-mask gives each document its own.
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(_loss_func, batch["loss_mask"])


def _mean_loss(losses_reduced) -> float:
    """The iteration's loss averaged over micro-batches and data-parallel replicas, on every rank."""
    contributes = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    total = torch.zeros(1, dtype=torch.float64)
    if contributes and losses_reduced:
        local = torch.stack([x["lm loss"].double() for x in losses_reduced]).mean()
        total += local / parallel_state.get_data_parallel_world_size()
    dist.all_reduce(total)
    return float(total.item())


def _mtp_losses(args) -> dict:
    """Megatron-LM's 'mtp_N loss' of the iteration, averaged over micro-batches and data-parallel
    replicas, on every rank. megatron's MTP layers add each micro-batch's loss to a tracker on the
    last stage; its own reduction averages with ReduceOp.AVG, which gloo lacks."""
    if not args.mtp_num_layers:
        return {}
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_ucp.mcore.compat import core_version

    tracker = MTPLossLoggingHelper.tracker
    total = torch.zeros(args.mtp_num_layers, dtype=torch.float64)
    contributes = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    # 0.19 renamed the losses' entry (and tracks token acceptance beside it)
    key = "loss_values" if core_version() >= (0, 19) else "values"
    if contributes and key in tracker:
        dp = parallel_state.get_data_parallel_world_size()
        total += tracker[key].double().cpu() / (args.num_microbatches * dp)
    tracker.clear()  # a later session may have another number of MTP layers
    dist.all_reduce(total)
    return {f"mtp_{i + 1} loss": float(v) for i, v in enumerate(total)}


def train_step(state, batches, args):
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses_reduced = _run_schedule(state, batches, args, forward_only=False)
    update_successful, grad_norm, _ = state.optimizer.step()
    state.scheduler.step(increment=args.global_batch_size)
    return _mean_loss(losses_reduced), grad_norm, update_successful


def _run_schedule(state, batches, args, forward_only: bool):
    """megatron's pipeline schedule over the micro-batches of one global batch."""
    iterators = [iter(batches) for _ in state.model]
    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=state.model,
        num_microbatches=len(batches),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=forward_only,
    )


def evaluate(args, state, dataset, iteration) -> float:
    """Mean loss of --eval-iters forward-only global batches of the validation split.

    The evaluation at iteration N reads block (N - 1) // --eval-interval of the split (Megatron-LM's
    uninterrupted order): a pure function of the iteration, whatever the layout or a resume.
    """
    gbs, dp = args.global_batch_size, parallel_state.get_data_parallel_world_size()
    first = (iteration - 1) // args.eval_interval * args.eval_iters * gbs
    for chunk in state.model:
        chunk.eval()
    total = 0.0
    with torch.no_grad():
        for k in range(args.eval_iters):
            batches = microbatches(dataset, first + k * gbs, gbs, args.micro_batch_size,
                                   parallel_state.get_data_parallel_rank(), dp)
            total += _mean_loss(_run_schedule(state, batches, args, forward_only=True))
    for chunk in state.model:
        chunk.train()
    return total / args.eval_iters


def _timed_save(args, state, iteration, consumed, monitor, sync=False) -> None:
    start = time.perf_counter()
    checkpointing.save(args, state, iteration, consumed, sync=sync)
    monitor.scalars(iteration, {"save-checkpoint-seconds": time.perf_counter() - start})


def _timed_local_save(args, state, tier, iteration, consumed, monitor) -> None:
    """A local-tier save: training waits for the in-memory copy only (the stall measured)."""
    start = time.perf_counter()
    tier.save(args, state, iteration, consumed)
    stall = time.perf_counter() - start
    monitor.scalars(iteration, {"local-save-stall-seconds": stall})
    if dist.get_rank() == 0:
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in tier.stall_parts.items())
        print(f" local save at iteration {iteration:8d} started ({stall:.3f} s stall{': ' + parts if parts else ''})",
              flush=True)


def _log(args, iteration, consumed, elapsed, lr, loss, grad_norm, extra=None) -> None:
    if dist.get_rank() != 0:
        return
    if iteration % args.log_interval == 0:
        print(
            f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {elapsed * 1000:.1f} | learning rate: {lr:.6E} |"
            f" global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} |"
            f" grad norm: {grad_norm:.3f} |"
            + "".join(f" {k}: {v:.6E} |" for k, v in (extra or {}).items() if k.startswith("mtp_")),
            flush=True,
        )
    if args.loss_log:
        with open(args.loss_log, "a") as f:
            record = dict(iteration=iteration, loss=loss, lr=lr, grad_norm=grad_norm,
                          consumed_samples=consumed, **(extra or {}))
            f.write(json.dumps(record) + "\n")


def _megatron_writes_plain_files() -> None:
    """megatron-core 0.16 turns its Multi-Storage Client path on by itself wherever the package
    is installed (msc_utils: `_FeatureFlag(_msc_available)`: dist_checkpointing then writes
    torch_dist through msc.open); Megatron-LM's trainer turns it on only with --enable-msc, and
    the own loop gives megatron local folders (object stores go through format/stores.py)."""
    try:
        from megatron.core.msc_utils import MultiStorageClientFeature
    except ImportError:
        return
    MultiStorageClientFeature.disable()


@contextlib.contextmanager
def session(argv=None):
    """Parse, initialise parallel state, build model/optimizer/scheduler; tear down at exit.

    Yields (args, state). Several sessions may run one after another in one process group.
    """
    progress.started()
    args = build_parser().parse_args(argv)
    state = None
    with contextlib.ExitStack() as stack:
        # From here on: Slurm's time-limit SIGTERM can come while a slow start (rendezvous,
        # build, load) is still under way; it stops the job after its first iteration.
        stack.enter_context(progress.signal_handler(args.exit_signal_handler))
        if args.cpu:
            from megatron_ucp.mcore import cpu_mode

            cpu_mode.enable()
        compat.apply()
        _megatron_writes_plain_files()
        init_distributed(args.cpu, args.distributed_timeout_minutes)
        stack.enter_context(collective.groups_of_this_scope())
        checkpointing.prepare_load(args)
        if args.elastic:
            elastic_layout(args, dist.get_world_size())
        validate(args, dist.get_world_size())
        checkpointing.keep_saved_vocab_padding(args)
        initialize(args)
        if args.fused_adam_standin:
            from megatron_ucp.mcore import fused_adam_standin

            stack.enter_context(fused_adam_standin.installed())
        try:
            state = build_train_state(args)
            yield args, state
        finally:
            if state is not None:
                checkpointing.finish_pending_save(state, args)
                release_train_state(state)
            parallel_state.destroy_model_parallel()
            destroy_num_microbatches_calculator()


def elastic_layout(args, world_size: int) -> None:
    """--elastic: fit the layout to this world size and resume the latest checkpoint universally.

    Rank 0 reads the tracker and the manifest and tells the others, so that every rank resumes
    the same checkpoint; the layout is the pure policy of megatron_ucp.mcore.elastic.
    """
    from megatron_ucp.engine.collective import on_rank_zero
    from megatron_ucp.mcore import elastic

    rank = dist.get_rank()
    found = on_rank_zero(checkpointing.latest_checkpoint, args)
    choice = elastic.choose_layout(world_size, elastic.dims_from_args(args),
                                   elastic.layout_from_args(args),
                                   elastic.Batch(args.micro_batch_size, args.global_batch_size))
    elastic.apply_to_args(args, choice)
    resuming = None
    if found is not None:
        iteration, _, saved = found
        args.load_universal = True
        args.ckpt_step = iteration  # every rank loads this one, even if the tracker moves on
        resuming = f"iteration {iteration} saved on {elastic.saved_description(saved)}"
    elif args.load:
        resuming, args.load = f"nothing: no checkpoint in {args.load} yet", None
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if rank == 0:
        line = elastic.summary(choice, resuming)
        print(f" {line}" + (f" (torchrun restart {restarts})" if restarts else ""), flush=True)
        warning = elastic.shared_store_warning(os.environ)
        if warning:
            print(f" {warning}", flush=True)


def pretrain(argv=None) -> list:
    """Train as the arguments say; return [(iteration, loss)] of the iterations run here."""
    with session(argv) as (args, state):
        return train(args, state)


def resume(args, state, tier=None):
    """Restore the local tier's newest sound iteration when it is newer than `--load`'s, else
    load `--load` if given; returns (iteration, consumed_samples)."""
    reseed = lambda it: set_seeds(args.seed + it)  # noqa: E731
    restored = checkpointing.restore_local(args, state, tier, reseed)
    if restored is not None:
        return restored
    if not args.load:
        return 0, 0
    return checkpointing.load(args, state, reseed=reseed)


def _check_restored_loss(args, tier, loss: float) -> None:
    """--local-ckpt-check-loss: a non-finite first loss after a local restore sets the local
    iteration aside (on every node) and stops, so that the restart takes the persistent tier
    instead of restoring the same state again."""
    import math

    from megatron_ucp.engine import local_restore
    from megatron_ucp.errors import IntegrityError

    if tier is None or tier.restored is None or not args.local_ckpt_check_loss:
        return
    restored, tier.restored = tier.restored, None
    if math.isfinite(loss):
        return
    local_restore.set_aside(tier, restored)
    raise IntegrityError(f"--local-ckpt-check-loss: the first loss after restoring local iteration {restored} "
                         f"is {loss}: that iteration is set aside in {args.local_ckpt_dir}; restart "
                         "to resume from the persistent checkpoint")


def _count(args, record: dict, update_successful) -> None:
    """Megatron-LM's bookkeeping, kept in checkpoints: model FLOPs so far, skipped updates
    (fp16 overflow)."""
    key = "num_floating_point_operations_so_far"
    record[key] = record.get(key, 0) + progress.num_floating_point_operations(args, args.global_batch_size)
    record["skipped_iterations"] = record.get("skipped_iterations", 0) + (0 if update_successful else 1)


def train(args, state) -> list:
    if args.save:
        checkpointing.claim_save_folder(args)
    monitor = Monitor(args)
    dataset, valid = build_datasets(args)
    tier = checkpointing.open_local_tier(args, state)
    start = time.perf_counter()
    iteration, consumed = resume(args, state, tier)
    if args.load or tier is not None:
        seconds = time.perf_counter() - start
        monitor.scalars(iteration, {"load-checkpoint-seconds": seconds})
        if iteration and dist.get_rank() == 0:
            print(f" resumed iteration {iteration} in {seconds:.2f} s", flush=True)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    history = []
    last = min(args.train_iters, args.exit_interval or args.train_iters)
    stopper, stop = progress.Stopper(args), None
    while iteration < last and stop is None:
        start = time.perf_counter()
        batches = microbatches(dataset, consumed, args.global_batch_size, args.micro_batch_size,
                               dp_rank, dp_size)
        lr = state.optimizer.param_groups[0]["lr"]  # the rate this update uses (the plug-in's meaning)
        loss, grad_norm, update_successful = train_step(state, batches, args)
        mtp = _mtp_losses(args)
        iteration += 1
        consumed += args.global_batch_size
        _count(args, state.progress, update_successful)
        _log(args, iteration, consumed, time.perf_counter() - start, lr, loss, grad_norm or 0.0,
             {**state.progress, **mtp})
        monitor.scalars(iteration, {"lm loss": loss, "learning-rate": lr,
                                    "grad-norm": float(grad_norm or 0.0), **mtp})
        history.append((iteration, loss))
        _check_restored_loss(args, tier, loss)
        if args.eval_interval and iteration % args.eval_interval == 0:
            monitor.validation(iteration, evaluate(args, state, valid, iteration))
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            _timed_save(args, state, iteration, consumed, monitor)
        elif tier is not None and iteration % args.local_save_interval == 0:
            _timed_local_save(args, state, tier, iteration, consumed, monitor)
        stop = stopper.should_stop()
    if stop is not None and dist.get_rank() == 0:
        print(f" {stop}: exiting after iteration {iteration}"
              + (", saving it first" if args.save else ""), flush=True)
    if args.eval_interval and iteration % args.eval_interval != 0 and history and stop is None:
        monitor.validation(iteration, evaluate(args, state, valid, iteration), final=True)
    if args.save and (not args.save_interval or iteration % args.save_interval != 0) and history:
        _timed_save(args, state, iteration, consumed, monitor, sync=stop is not None)
    checkpointing.finish_pending_save(state, args)
    if tier is not None:
        tier.close()
    if args.save:
        checkpointing.release_save_folder(args)
    monitor.close()
    return history
