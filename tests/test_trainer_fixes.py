"""The two megatron-core bugs the plug-in mends for GPU users too (megatron_lm/trainer_fixes.py),
each reproduced on the installed wheel first, then shown mended."""

import importlib
import importlib.util
import types

import pytest
import torch

from megatron_ucp.megatron_lm import trainer_fixes


@pytest.fixture
def restore(monkeypatch):
    """Whatever trainer_fixes patches is put back after the test."""
    utils = importlib.import_module("megatron.core.datasets.utils")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    for name in ("load_parameter_state_from_dp_reshardable", "load_parameter_state_from_dp_zero"):
        monkeypatch.setattr(distrib.DistributedOptimizer, name, getattr(distrib.DistributedOptimizer, name))
    return utils, distrib


def test_the_wheels_compiled_dataset_helpers_are_not_rebuilt(restore, capfd):
    utils, _ = restore
    with pytest.raises(SystemExit):  # the wheel ships no Makefile: megatron exits
        utils.compile_helpers()
    trainer_fixes.apply()
    utils.compile_helpers()  # nothing to build: helpers_cpp imports
    importlib.import_module("megatron.core.datasets.helpers_cpp")


def _optimizer_loading_into_a_view(distrib):
    """A stand-in DistributedOptimizer with one fp32 main parameter that is a view of its model
    parameter (a leaf that requires grad), as megatron's fp32 distributed optimizer keeps it."""
    model_param = torch.nn.Parameter(torch.zeros(4))
    main_param = model_param.view(-1)
    fake = types.SimpleNamespace(per_bucket_numel_unpadded=None,
                                 gbuf_ranges=[{torch.float32: [{"param_map": {model_param: None}}]}])

    def set_states(param, tensors):  # megatron's non-precision-aware branch: main_param.copy_()
        main_param.copy_(tensors["param"])

    fake._set_main_param_and_optimizer_states = set_states
    state = {0: {torch.float32: [[{"padding": False, "param": torch.ones(4)}]]}}
    return fake, state, model_param


def test_dp_reshardable_state_copies_run_without_grad(restore):
    _, distrib = restore
    fake, state, model_param = _optimizer_loading_into_a_view(distrib)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        distrib.DistributedOptimizer.load_parameter_state_from_dp_reshardable(fake, state)
    trainer_fixes.apply()
    distrib.DistributedOptimizer.load_parameter_state_from_dp_reshardable(fake, state)
    assert torch.equal(model_param.detach(), torch.ones(4))
    assert getattr(distrib.DistributedOptimizer.load_parameter_state_from_dp_zero, "_ucp_no_grad", False)


def test_no_eval_interval_sizes_one_evaluation_after_training(monkeypatch):
    """--eval-interval's default None: megatron's sample counts divided by it (TypeError, 0.19.2
    training.py:4481); mended, the validation split holds the one evaluation after training."""
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron-core without megatron.training (0.16's wheel): no trainer to mend")
    training = importlib.import_module("megatron.training.training")
    global_vars = importlib.import_module("megatron.training.global_vars")
    for name in ("get_train_valid_test_num_samples", "build_train_valid_test_data_loaders"):
        fn = getattr(training, name)  # the wheel's own, whether or not an earlier test mended it
        monkeypatch.setattr(training, name, fn.__wrapped__ if getattr(fn, "_ucp_eval_interval", False) else fn)
    args = types.SimpleNamespace(train_samples=None, train_iters=10, global_batch_size=8, full_validation=False,
                                 skip_train=False, eval_interval=None, eval_iters=3, start_eval_at_iter=None,
                                 phase_transition_iterations=None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    with pytest.raises(TypeError):
        training.get_train_valid_test_num_samples()
    trainer_fixes.apply()
    train, valid, test = training.get_train_valid_test_num_samples()[:3]
    assert (train, valid, test) == (80, 24, 24) and args.eval_interval is None
