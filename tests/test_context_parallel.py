"""Context parallelism in the CPU mode: megatron's load-balanced sequence chunks
(mcore/context_parallel.py) and the CPU core attention over them, whose values and gradients
equal those of the whole sequence on one rank (CP1)."""

import os
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, strategies as st

from harness import free_port
from megatron_ucp.mcore.context_parallel import chunks_of_rank, global_order, positions_of_rank


@given(st.integers(1, 8), st.integers(1, 6))
def test_ranks_hold_every_position_once_and_balanced(cp, chunk):
    held = [positions_of_rank(cp, r, 2 * chunk) for r in range(cp)]
    assert sorted(p for ps in held for p in ps) == list(range(2 * cp * chunk))
    # causal work balance: every rank's positions sum to the same total
    assert len({sum(ps) for ps in held}) == 1


@given(st.integers(1, 8), st.integers(1, 6))
def test_global_order_puts_the_gather_in_sequence_order(cp, chunk):
    gathered = [p for r in range(cp) for p in positions_of_rank(cp, r, 2 * chunk)]
    assert [gathered[i] for i in global_order(cp, 2 * chunk)] == list(range(2 * cp * chunk))


def test_rank_outside_the_group_and_odd_lengths_are_refused():
    for bad in (lambda: chunks_of_rank(2, 2), lambda: positions_of_rank(2, 0, 3)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("accepted")


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _config(cp):
    return types.SimpleNamespace(context_parallel_size=cp, num_attention_heads=4, num_query_groups=2,
                                 kv_channels=8, attention_dropout=0.0, sequence_parallel=False,
                                 multi_latent_attention=False)


def _attention(cp, tp_group, cp_group):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_ucp.mcore.cpu_mode import CpuCoreAttention

    return CpuCoreAttention(_config(cp), 1, AttnMaskType.causal, "self",
                            pg_collection=types.SimpleNamespace(tp=tp_group, cp=cp_group))


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        from megatron.core.utils import get_batch_on_this_cp_rank
        from megatron_ucp.mcore import cpu_mode

        cpu_mode.enable()
        get_cuda_rng_tracker().add("model-parallel-rng", 1234)
        # megatron's own split is the oracle of positions_of_rank
        for cp in (1, 2, 3, 4):
            for r in range(cp):
                tokens = torch.arange(2 * cp * 3)[None]
                split = get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=_Group(cp, r))["tokens"]
                assert split[0].tolist() == positions_of_rank(cp, r, 6), (cp, r, split)

        s, b, heads, groups, d = 16, 2, 4, 2, 8
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups))
        weight = torch.randn(s, b, heads * d, generator=g)
        own = [dist.new_group([i]) for i in range(2)][rank]  # a TP group of one

        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        out1 = _attention(1, own, None)(*whole, None)
        (out1 * weight).sum().backward()

        mine = torch.tensor(positions_of_rank(2, rank, s // 2))
        local = [t.index_select(0, mine).clone().requires_grad_() for t in (q, k, v)]
        out2 = _attention(2, own, dist.group.WORLD)(*local, None)
        (out2 * weight.index_select(0, mine)).sum().backward()

        results[rank] = {
            "value": (out2 - out1.index_select(0, mine)).abs().max().item(),
            "grads": [(a.grad - w.grad.index_select(0, mine)).abs().max().item()
                      for a, w in zip(local, whole)],
            "grad_scale": min(w.grad.abs().max().item() for w in whole),
        }
    finally:
        dist.destroy_process_group()


def test_cp2_attention_values_and_gradients_equal_cp1():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2)
    for rank in range(2):
        r = results[rank]
        assert r["grad_scale"] > 1e-2, "the gradients compared are not all zero"
        assert r["value"] <= 1e-6, r
        assert max(r["grads"]) <= 1e-5, r  # query, key, value: fp32 rounding of other sums
