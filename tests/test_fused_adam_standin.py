"""The fused-Adam stand-in keeps transformer-engine's FusedAdam contract, and the state adapter
reads and writes both Adams' step conventions (in-process, no megatron processes)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_ucp.mcore.fused_adam_standin import FusedAdamStandIn
from megatron_ucp.mcore.optimizer_state import keeps_step_per_param, read_step, write_step


def _pair(**kw):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(7, 5))
    b = torch.nn.Parameter(a.detach().clone())
    return a, b, torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1), FusedAdamStandIn([b], lr=1e-2, weight_decay=0.1, **kw)


def _step(params_and_opts, grad):
    for p, opt in params_and_opts:
        p.grad = grad.clone()
        opt.step()


def test_fp32_updates_are_torch_adamw_bit_for_bit():
    a, b, torch_adam, fused = _pair()
    for _ in range(6):
        _step([(a, torch_adam), (b, fused)], torch.randn(7, 5))
    assert torch.equal(a, b)
    assert torch.equal(torch_adam.state[a]["exp_avg_sq"], fused.state[b]["exp_avg_sq"])


def test_step_in_the_param_groups_and_state_created_lazily():
    p = torch.nn.Parameter(torch.randn(3))
    fused = FusedAdamStandIn([{"params": [p]}, {"params": []}])
    assert len(fused.state[p]) == 0 and "step" not in fused.param_groups[0]
    for _ in range(3):
        p.grad = torch.ones(3)
        fused.step()
    assert fused.param_groups[0]["step"] == 3
    assert "step" not in fused.param_groups[1]  # empty groups are skipped, as in TE
    assert sorted(fused.state[p]) == ["exp_avg", "exp_avg_sq"]  # no per-parameter step


def test_bf16_moments_behind_the_accessors():
    p = torch.nn.Parameter(torch.randn(64))
    fused = FusedAdamStandIn([p], exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    p.grad = torch.randn(64)
    fused.step()
    assert fused.state[p]["exp_avg"].dtype == torch.bfloat16
    unscaled = fused.get_unscaled_state(p, "exp_avg")
    assert unscaled.dtype == torch.float32
    values = torch.randn(64).bfloat16().float()  # exact in bf16
    fused.set_scaled_state(p, "exp_avg", values)
    assert torch.equal(fused.get_unscaled_state(p, "exp_avg"), values)


def test_fp16_states_are_scaled():
    p = torch.nn.Parameter(torch.randn(64))
    fused = FusedAdamStandIn([p], exp_avg_sq_dtype=torch.float16)
    fused.initialize_state(p)
    big = torch.linspace(-1e6, 1e6, 64)  # beyond fp16's range unscaled
    fused.set_scaled_state(p, "exp_avg_sq", big)
    assert fused.state[p]["exp_avg_sq"].dtype == torch.float16
    assert torch.isfinite(fused.state[p]["exp_avg_sq"]).all()
    assert torch.allclose(fused.get_unscaled_state(p, "exp_avg_sq"), big, rtol=1e-3)


def test_master_weights_hold_the_fp32_values_of_bf16_params():
    p = torch.nn.Parameter(torch.randn(16).bfloat16())
    fused = FusedAdamStandIn([p], master_weights=True, use_decoupled_grad=True)
    p.decoupled_grad = torch.randn(16)
    fused.step()
    master = fused.get_unscaled_state(p, "master_param")
    assert master.dtype == torch.float32 and torch.equal(p.detach(), master.bfloat16())


def test_state_dict_hands_out_unscaled_fp32_and_takes_it_back():
    p = torch.nn.Parameter(torch.randn(8))
    fused = FusedAdamStandIn([p], exp_avg_dtype=torch.bfloat16)
    p.grad = torch.randn(8)
    fused.step()
    sd = fused.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32 and sd["param_groups"][0]["step"] == 1
    q = torch.nn.Parameter(p.detach().clone())
    other = FusedAdamStandIn([q], exp_avg_dtype=torch.bfloat16)
    other.load_state_dict(sd)
    assert other.state[q]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(other.state[q]["exp_avg"], fused.state[p]["exp_avg"])


def test_unreproduced_options_are_refused():
    p = torch.nn.Parameter(torch.randn(2))
    for kw in ({"exp_avg_dtype": torch.uint8}, {"capturable": True}, {"store_param_remainders": True}):
        with pytest.raises(RuntimeError, match="not reproduced"):
            FusedAdamStandIn([p], **kw)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps), lambda ps: FusedAdamStandIn(ps)])
def test_the_step_count_in_either_convention(make):
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    inner = make(params)
    megatron_like = SimpleNamespace(optimizer=inner)
    assert read_step(megatron_like) == 0
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(4)
        inner.step()
    assert read_step(megatron_like) == 4
    write_step(megatron_like, 11)
    assert read_step(megatron_like) == 11
    if keeps_step_per_param(inner):  # one tensor per parameter: torch increments each in place
        steps = [inner.state[p]["step"] for p in params]
        assert len({id(s) for s in steps}) == 3
    else:
        assert all(g["step"] == 11 for g in inner.param_groups)
    inner.step()
    assert read_step(megatron_like) == 12


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps), lambda ps: FusedAdamStandIn(ps)])
def test_saved_state_dicts_give_their_step_in_either_convention(make):
    """What the converters read from megatron's formats: torch's per-parameter steps, or
    FusedAdam's group steps (an empty group has none; stripped `params` still count)."""
    from megatron_ucp.mcore.optimizer_state import saved_steps

    p = torch.nn.Parameter(torch.randn(4))
    inner = make([{"params": [p]}, {"params": []}])
    for _ in range(3):
        p.grad = torch.randn(4)
        inner.step()
    sd = inner.state_dict()
    assert saved_steps(sd["param_groups"], sd["state"].values()) == {3}
    stripped = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"][:1]]
    assert saved_steps(stripped + [{"step": None}]) == ({3} if "step" in sd["param_groups"][0] else set())
