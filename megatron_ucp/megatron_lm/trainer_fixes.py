"""Two bugs of megatron-core's trainer that GPU users hit too, mended by `install()` whatever
the flags; each mend applies only where the installed release has the bug."""

import functools
import importlib

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


def apply() -> None:
    _compiled_helpers_kept()
    _state_copies_without_grad()
