"""What a run reports besides its iteration lines: validation losses and TensorBoard scalars.

Scalars go through `torch.utils.tensorboard` from the last rank, as Megatron-LM writes them,
under Megatron-LM's names ("lm loss", "learning-rate", "grad-norm", "lm loss validation").
"""

import importlib.util
import json
import math

import torch.distributed as dist

from megatron_ucp.errors import ConfigError


def tensorboard_writer(log_dir: str):
    """A SummaryWriter on the last rank, None elsewhere; every rank refuses a missing package."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the `tensorboard` package: pip install tensorboard "
                          "(or megatron-ucp[tensorboard])")
    if dist.get_rank() != dist.get_world_size() - 1:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir)


class Monitor:
    """Validation lines (rank 0, and --loss-log) and TensorBoard scalars (last rank)."""

    def __init__(self, args):
        self.args = args
        self.writer = tensorboard_writer(args.tensorboard_dir) if args.tensorboard_dir else None

    def scalars(self, iteration: int, values: dict) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, iteration)

    def validation(self, iteration: int, loss: float, final: bool = False) -> None:
        """Megatron-LM's line: `validation loss at iteration N | lm loss value: X | lm loss PPL: Y |`
        (`... at iteration N on validation set | ...` after training)."""
        ppl = math.exp(min(20.0, loss))
        self.scalars(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl})
        if dist.get_rank() != 0:
            return
        where = f"iteration {iteration}" + (" on validation set" if final else "")
        line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        if self.args.loss_log:
            with open(self.args.loss_log, "a") as f:
                f.write(json.dumps(dict(iteration=iteration, validation_loss=loss,
                                        validation_ppl=ppl)) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
