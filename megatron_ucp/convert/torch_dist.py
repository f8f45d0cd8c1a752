"""Convert a megatron-core `torch_dist` checkpoint into a universal one, streaming.

No GPU and no process of the source layout: one process reads the checkpoint's DCP metadata
and, for each atomic tensor, only the chunks that hold it (`DcpReader.read_box`), assembles one
state at a time and writes it once (megatron_ucp/convert/writer.py). Memory holds a few atomic
tensors, never the checkpoint.

Its parts: torch_dist_plan.py maps every atomic tensor to the checkpoint's keys through
megatron's own description of a model built from the stored arguments; the optimizer state is
read like the weights where megatron keeps it in the model's coordinates (no distributed
optimizer, `fully_reshardable`), and found in bucket tensors by a derived buffer layout, checked
three ways, under megatron's default `dp_reshardable` (torch_dist_buckets.py);
torch_dist_sources.py reads one state of one atomic tensor from where the plan found it; here,
the conversion itself.
"""

import time
from typing import Dict

import numpy as np

from megatron_ucp.convert import writer as stream_write
from megatron_ucp.convert.dcp_reader import DcpReader
from megatron_ucp.convert.torch_dist_plan import Plan, plan_conversion
from megatron_ucp.convert.torch_dist_sources import Atomic, from_boxes, from_buckets
from megatron_ucp.format.tensor_entry import TensorEntry


def assemble(entry: Atomic, plan: Plan, reader: DcpReader, state: str) -> Dict[str, np.ndarray]:
    """One state of one atomic tensor as {part: array}."""
    if plan.sharding == "dp_reshardable" and not entry.buffer:
        return from_buckets(entry, reader, state)
    return from_boxes(entry, reader, entry.prefixes.get(state, ""))


def convert(iter_dir: str, output_dir: str, extra_argv=(), nproc=None, workers: int = 1,
            progress: bool = True) -> dict:
    """Convert one torch_dist `iter_XXXXXXX` folder into `output_dir`; returns the summary."""
    started = time.perf_counter()
    plan = plan_conversion(iter_dir, extra_argv, nproc)
    reader = DcpReader(iter_dir)
    metas = {n: TensorEntry.new(n, e.shape, e.padded_rows is not None, e.padding_rows, e.states, e.buffer)
             for n, e in plan.atomics.items()}

    def opener(name):
        entry = plan.atomics[name]
        return lambda state: assemble(entry, plan, reader, state)

    try:
        return stream_write.write_checkpoint(output_dir, plan.iteration, metas, opener, plan.head, plan.rng,
                                             workers, progress, started)
    finally:
        reader.close()
