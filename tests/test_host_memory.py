"""Huge-page advice on the host buffers a load or an async save fills at once."""

import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_ucp.format import host_memory
from megatron_ucp.format.host_memory import HUGE_PAGE, huge_range


@given(st.integers(0, 2**40), st.integers(0, 2**32), st.sampled_from([4096, HUGE_PAGE]))
def test_huge_range_is_the_largest_aligned_span_inside(address, nbytes, page):
    span = huge_range(address, nbytes, page)
    first_full = -(-address // page) * page  # the first page boundary at or after address
    if span is None:
        assert first_full + page > address + nbytes  # not one whole page fits
        return
    start, length = span
    assert start % page == 0 and length % page == 0 and length > 0
    assert address <= start and start + length <= address + nbytes
    assert start - address < page and address + nbytes - (start + length) < page


def _vm_flags(address: int) -> list:
    """The VmFlags of the mapping of this process that holds `address` (Linux smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._MADVISE is None,
    reason="transparent huge pages are a Linux feature")


@linux_thp
def test_load_buffers_are_advised_to_use_huge_pages(monkeypatch):
    monkeypatch.delenv("UCP_HUGE_PAGES", raising=False)
    moments = host_memory.empty_like(torch.zeros(3_000_000))  # 12 MB: whole huge pages inside
    assert moments.shape == (3_000_000,) and moments.dtype == torch.float32
    start, _ = huge_range(moments.data_ptr(), moments.numel() * 4)
    assert "hg" in _vm_flags(start)
    buf = host_memory.empty_fp32(3_000_000)
    start, _ = huge_range(buf.ctypes.data, buf.nbytes)
    assert "hg" in _vm_flags(start)


@linux_thp
def test_huge_pages_opt_out(monkeypatch):
    monkeypatch.setenv("UCP_HUGE_PAGES", "0")
    t = host_memory.empty_like(torch.zeros(3_000_000))
    assert host_memory.advise_huge_pages(t) is False


def test_small_or_device_tensors_are_left_alone():
    assert host_memory.advise_huge_pages(torch.zeros(1000)) is False  # no whole huge page inside
    assert host_memory.advise_huge_pages(torch.zeros(3_000_000, device="meta")) is False


def _item(name, numel):
    from types import SimpleNamespace

    return SimpleNamespace(key=(name, 0), region=SimpleNamespace(numel=numel))


def test_async_snapshot_copies_any_dtype_into_reused_fp32_staging():
    """The async stall's copy: one pass from the source (bf16 here) into fp32 staging buffers,
    which the next save reuses; a sync save gets views of fp32 sources, no copy."""
    from megatron_ucp.engine.save import _snapshot

    weight = torch.randn(3_000_000, dtype=torch.bfloat16)
    moment = torch.randn(1_000_000)
    items = [_item("w", 2_000_000), _item("m", 1_000_000)]
    sources = {("w", 0): (500_000, {"param": weight}), ("m", 0): (0, {"exp_avg": moment})}
    first = _snapshot(items, sources, None, copy=True, staging={})
    w = first[("w", 0)]["param"]
    assert w.dtype == np.float32 and w.shape == (2_000_000,)
    assert torch.equal(torch.from_numpy(w), weight[500_000:2_500_000].float())
    weight.mul_(2)  # training goes on; the snapshot must not move
    assert torch.equal(torch.from_numpy(w), (weight[500_000:2_500_000] / 2).float())
    staging = {(("w", 0), "param"): w, (("m", 0), "exp_avg"): first[("m", 0)]["exp_avg"]}
    second = _snapshot(items, sources, None, copy=True, staging=staging)
    assert second[("w", 0)]["param"] is w  # the same buffer, refilled
    assert torch.equal(torch.from_numpy(w), weight[500_000:2_500_000].float())
    sync = _snapshot(items[1:], sources, None, copy=False)
    assert np.shares_memory(sync[("m", 0)]["exp_avg"], moment.numpy())
