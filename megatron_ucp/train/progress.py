"""What Megatron-LM's loop keeps besides the iteration, and when it stops early.

- `num_floating_point_operations(args, batch_size)`: the model FLOPs of one iteration, Megatron-LM's
  formula for GPT (training.py, after "APPENDIX: FLOATING-POINT OPERATIONS" of arXiv:2104.04473);
  summed into `num_floating_point_operations_so_far` and kept in the checkpoint.
- `Stopper`: `--exit-signal-handler` (SIGTERM: Slurm's `--signal=TERM@N`, the example sbatch
  scripts passing on their time-limit warning, scancel, preemption, torchrun forwarding its own)
  and `--exit-duration-in-mins`. Every rank must stop after the same
  iteration, so after each one the ranks all-reduce (MAX) a flag, as Megatron-LM's
  DistributedSignalHandler does; rank 0's clock decides the duration.
"""

import contextlib
import signal
import time

import torch
import torch.distributed as dist


def num_floating_point_operations(args, batch_size: int) -> float:
    """Forward and backward FLOPs of `batch_size` sequences (GEMMs x 3 passes x 2 per MAC)."""
    kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    query_ratio = kv_channels * args.num_attention_heads / args.hidden_size
    routed = 1 if args.num_experts is None else args.moe_router_topk
    ffn = args.ffn_hidden_size if args.num_experts is None else (args.moe_ffn_hidden_size or args.ffn_hidden_size)
    gated = 3 / 2 if args.swiglu else 1
    shared = args.moe_shared_expert_intermediate_size or 0
    per_layer = (
        (1 + args.num_query_groups / args.num_attention_heads + args.seq_length / args.hidden_size) * query_ratio
        + ffn / args.hidden_size * routed * gated
        + shared / args.hidden_size * gated
        + args.padded_vocab_size / (2 * args.num_layers * args.hidden_size)
    )
    return 12.0 * batch_size * args.seq_length * args.num_layers * args.hidden_size ** 2 * per_layer


_STARTED = None


def started() -> None:
    """The job's start (Megatron-LM's --exit-duration-in-mins counts from there, not from the
    first iteration: the time limit includes building and loading)."""
    global _STARTED
    _STARTED = time.monotonic()


_RECEIVED = False


def _on_signal(signum, frame) -> None:
    global _RECEIVED
    _RECEIVED = True  # acted on after an iteration, by every rank together


@contextlib.contextmanager
def signal_handler(enabled: bool):
    """--exit-signal-handler: SIGTERM sets a flag from the job's start (one during the build or
    the load stops the job after its first iteration); the previous handler comes back at exit.

    SIGINT (Ctrl-C; torchrun passes it on to its workers) ends a process at once, the kernel's
    default: Python's KeyboardInterrupt comes only between bytecodes, so a rank waiting in a
    collective for a peer that had already unwound waited for torchrun's SIGKILL, 30 s later,
    and every rank printed a traceback. A save it cuts short leaves the previous checkpoint
    (the commit protocol); the next save into the folder removes the temporary folder."""
    global _RECEIVED
    _RECEIVED = False
    previous_int = signal.signal(signal.SIGINT, signal.SIG_DFL)
    previous = signal.signal(signal.SIGTERM, _on_signal) if enabled else None
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int)
        if enabled:
            signal.signal(signal.SIGTERM, previous)


class Stopper:
    """Says, on every rank alike, whether to stop after this iteration (and why)."""

    def __init__(self, args):
        self.signal_handler = args.exit_signal_handler
        self.duration_s = None if args.exit_duration_in_mins is None else args.exit_duration_in_mins * 60
        self.start = _STARTED if _STARTED is not None else time.monotonic()
        self.device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())

    def should_stop(self):
        """None to go on; else the reason, the same on every rank (a collective when enabled)."""
        if not self.signal_handler and self.duration_s is None:
            return None
        timed_out = (self.duration_s is not None and dist.get_rank() == 0
                     and time.monotonic() - self.start > self.duration_s)
        flags = torch.tensor([int(_RECEIVED), int(timed_out)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item():
            return "SIGTERM received (--exit-signal-handler)"
        if flags[1].item():
            return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        return None
