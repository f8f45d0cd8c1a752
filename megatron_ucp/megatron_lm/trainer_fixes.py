"""Bugs of megatron-core's trainer that GPU users hit too, mended by `install()` whatever the
flags; each mend applies only where the installed release has the bug."""

import functools
import importlib
import importlib.util

import torch


def _compiled_helpers_kept():
    """initialize.py:177 runs `make` in megatron/core/datasets for the dataset index helpers, but
    the wheel ships them compiled (helpers_cpp) and no Makefile: `make` fails and the trainer
    calls sys.exit(1). Where the compiled module imports, there is nothing to build."""
    utils = importlib.import_module("megatron.core.datasets.utils")
    original = utils.compile_helpers

    @functools.wraps(original)
    def compile_helpers():
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
            return
        except ImportError:
            return original()

    utils.compile_helpers = compile_helpers


def _state_copies_without_grad():
    """DistributedOptimizer.load_parameter_state_from_dp_reshardable / _from_dp_zero
    (0.19.2 distrib_optimizer.py:2061/2254) copy into the main parameters without the no_grad
    their siblings have: in fp32 a main parameter is a view of a model parameter (a leaf that
    requires grad), and the in-place copy raises."""
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    for name in ("load_parameter_state_from_dp_reshardable", "load_parameter_state_from_dp_zero"):
        original = getattr(distrib.DistributedOptimizer, name, None)
        if original is None or getattr(original, "_ucp_no_grad", False):
            continue
        wrapped = functools.wraps(original)(torch.no_grad()(original))
        wrapped._ucp_no_grad = True
        setattr(distrib.DistributedOptimizer, name, wrapped)


# An evaluation interval longer than any run: `train_iters // NEVER` is 0.
NEVER = 2**62


def _no_eval_interval():
    """--eval-interval's default is None, "no evaluation during training" (0.19.2
    training_config.py:119, 0.16.1's too), but training.py's sample counts divide by it:
    TypeError in get_train_valid_test_num_samples (0.19.2 training.py:4481, 0.16.1 3307) and, on
    a resume, in build_train_valid_test_data_loaders (4532; 3354). Inside them None reads as an
    interval longer than the run: the validation split sized for the one evaluation after
    training, none consumed before it."""
    if importlib.util.find_spec("megatron.training") is None:  # megatron-core alone (0.16's wheel)
        return
    training = importlib.import_module("megatron.training.training")
    for name in ("get_train_valid_test_num_samples", "build_train_valid_test_data_loaders"):
        original = getattr(training, name, None)
        if original is None or getattr(original, "_ucp_eval_interval", False):
            continue

        @functools.wraps(original)
        def wrapped(*args, _original=original, **kwargs):
            margs = importlib.import_module("megatron.training.global_vars").get_args()
            if margs.eval_interval is not None:
                return _original(*args, **kwargs)
            margs.eval_interval = NEVER
            try:
                return _original(*args, **kwargs)
            finally:
                margs.eval_interval = None

        wrapped._ucp_eval_interval = True
        from megatron_ucp.megatron_lm.patching import replace_everywhere

        replace_everywhere(original, wrapped)


def apply() -> None:
    _compiled_helpers_kept()
    _state_copies_without_grad()
    _no_eval_interval()
