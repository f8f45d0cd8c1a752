"""How many files a rank keeps in flight: tensor_io.in_parallel and tensor_io.read_threads."""

import time

import pytest

from megatron_ucp.format import tensor_io


def test_in_parallel_keeps_order_and_raises_the_error():
    def slow_square(x):
        time.sleep(0.01 * (5 - x))  # later jobs finish first
        return x * x

    assert tensor_io.in_parallel(slow_square, list(range(5)), threads=4) == [0, 1, 4, 9, 16]
    assert tensor_io.in_parallel(slow_square, list(range(5)), threads=1) == [0, 1, 4, 9, 16]

    def fails_on_three(x):
        if x == 3:
            raise ValueError("job 3")
        return x

    with pytest.raises(ValueError, match="job 3"):
        tensor_io.in_parallel(fails_on_three, list(range(6)), threads=3)


@pytest.mark.parametrize("cores,local_ranks,want", [(2, 4, 1), (2, 1, 2), (16, 8, 2), (96, 8, 4), (8, 1, 4)])
def test_read_threads_share_the_node_cores(monkeypatch, cores, local_ranks, want):
    monkeypatch.setattr(tensor_io.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setenv("UCP_IO_THREADS", "4")
    assert tensor_io.read_threads() == want
