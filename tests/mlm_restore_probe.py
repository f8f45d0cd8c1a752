"""Issue 46's differential test in Megatron-LM's trainer (megatron-core >= 0.17), run through the
plug-in in one torchrun group:

    UCP_PROBE_SPEC=SPEC.json torchrun ... -m megatron_ucp.megatron_lm --cpu tests/mlm_restore_probe.py

SPEC is {"result": PATH, "pairs": [{"name", "local": [flags], "persistent": [flags]}]}. For each
pair the trainer's pretrain() runs twice, as a restart from the local tier and as a restart
from the persistent checkpoint: each builds its model, restores (the plug-in's load_checkpoint)
and builds its data iterators as the trainer does; instead of training, each rank takes what it
holds (tests/state_probe.py, with the iteration, consumed samples and the next batch of the
trainer's own iterator). The two are compared in memory; rank 0 writes every rank's
differences to PATH.
"""

import json
import os
import sys
import traceback

import torch.distributed as dist
from state_probe import differences, snapshot

HELD = {}


def _probe_train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, *rest, **kwargs):
    """Megatron-LM's train(), replaced: what this rank holds after the restore, and no step."""
    from megatron.training import get_args

    args = get_args()
    iterators = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
    held = [it for it in iterators if it is not None]
    tokens = next(held[0])["tokens"] if held else None
    HELD["state"] = snapshot(model, optimizer, opt_param_scheduler, iteration=args.iteration,
                             consumed_samples=args.consumed_train_samples, next_tokens=tokens,
                             padded_vocab=args.padded_vocab_size,
                             skipped_samples=getattr(args, "skipped_train_samples", None),
                             flops=args.num_floating_point_operations_so_far)
    return args.iteration, args.num_floating_point_operations_so_far


def _teardown() -> None:
    """Megatron-LM's global state, reset for the next pretrain() in this process."""
    from megatron.core import num_microbatches_calculator, parallel_state, rerun_state_machine
    from megatron.training import global_vars

    from megatron_ucp.megatron_lm import checkpoint, local_tier

    global_vars.destroy_global_vars()
    parallel_state.destroy_model_parallel()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    rerun_state_machine.destroy_rerun_state_machine()
    local_tier._TIER.clear()
    checkpoint._PENDING.pop("save", None)


def _held_after(argv) -> dict:
    from megatron.training import training

    from megatron_ucp.megatron_lm import gpt

    HELD.clear()
    original, training.train = training.train, _probe_train
    sys.argv = [sys.argv[0]] + argv
    try:
        gpt.main()
    finally:
        training.train = original
        _teardown()
    return HELD.pop("state")


def main() -> None:
    with open(os.environ["UCP_PROBE_SPEC"]) as f:
        spec = json.load(f)
    results = {}
    for pair in spec["pairs"]:
        try:
            local = _held_after(pair["local"])
            persistent = _held_after(pair["persistent"])
            found = differences(local, persistent)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, {"differences": found, "keys": len(local),
                                              "iteration": local.get("iteration")})
            results[pair["name"]] = {"ranks": everyone}
        except Exception as e:  # recorded so that the test names the failing pair
            results[pair["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            break
        finally:
            if int(os.environ.get("RANK", "0")) == 0:
                with open(spec["result"] + ".tmp", "w") as f:
                    json.dump(results, f, indent=1)
                os.replace(spec["result"] + ".tmp", spec["result"])


if __name__ == "__main__":
    main()
