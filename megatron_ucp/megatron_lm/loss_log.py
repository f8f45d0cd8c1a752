"""`--loss-log PATH`: one JSON line per iteration from Megatron-LM's trainer, as the own loop
writes them: the iteration, its loss over the global batch and the learning rate its update used.

The loss is the one `train_step` returns on the last pipeline stage, already summed over the
micro-batches and all-reduced over data (and context) parallelism: the value Megatron-LM logs,
without its log's accumulation across iterations (the first logged iteration after a start is
not reset). One rank writes it: the last stage's first tensor- and data-parallel rank.
"""

import functools
import importlib
import json
import os


def _writes() -> bool:
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)


def record(iteration: int, losses: dict, lr: float) -> dict:
    """The line of one iteration: its losses (each reduced value, by Megatron-LM's key) and lr."""
    line = {"iteration": iteration, "lr": lr}
    for key, value in losses.items():
        line["loss" if key == "lm loss" else key] = float(value)
    return line


def read(path) -> dict:
    """{iteration: loss} of a loss log (either loop's): its training lines, those with a "loss"
    (the own loop writes validation lines between them); a later line for an iteration (a run
    resumed into the same log) wins."""
    losses = {}
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):  # a line still being written is not yet a record
                r = json.loads(line)
                if "loss" in r:
                    losses[r["iteration"]] = r["loss"]
    return losses


def install() -> None:
    """Wrap `training.train_step` (0.19.2 training.py:2336, its reduced losses at 2548; 0.17.0
    1783 and 1933), which the training loop calls by its module name."""
    training = importlib.import_module("megatron.training.training")
    original = training.train_step

    @functools.wraps(original)
    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        args = importlib.import_module("megatron.training.global_vars").get_args()
        if not getattr(args, "loss_log", None):
            return original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        lr = optimizer.param_groups[0]["lr"] if optimizer is not None and optimizer.param_groups else None
        result = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        if result[0] and _writes():
            os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
            with open(args.loss_log, "a") as f:
                f.write(json.dumps(record(args.curr_iteration + 1, result[0], lr)) + "\n")
        return result

    from megatron_ucp.megatron_lm.patching import replace_everywhere

    replace_everywhere(original, train_step)
