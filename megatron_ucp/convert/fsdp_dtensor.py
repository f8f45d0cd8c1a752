"""Convert a Megatron-FSDP `fsdp_dtensor` checkpoint into a universal one, streaming.

Megatron-LM's `--use-megatron-fsdp --ckpt-format fsdp_dtensor` saves a plain torch DCP
checkpoint of global tensors named by module path (fsdp_dtensor_keys.py). One process, no GPU,
no process group: fsdp_dtensor_plan.py maps each atomic tensor to its keys through a meta model
built from the stored arguments; here each state of each atomic tensor is read from only the
chunks that hold it (`DcpReader.read_box`) and written once (writer.py), as torch_dist.py does.
"""

import time

from megatron_ucp.convert import writer as stream_write
from megatron_ucp.convert.dcp_reader import DcpReader
from megatron_ucp.convert.fsdp_dtensor_plan import plan_conversion, suffix
from megatron_ucp.convert.torch_dist_sources import from_boxes
from megatron_ucp.format.tensor_entry import TensorEntry


def convert(iter_dir: str, output_dir: str, extra_argv=(), workers: int = 1, progress: bool = True,
            origin=None) -> dict:
    """Convert one fsdp_dtensor `iter_XXXXXXX` folder into `output_dir`; returns the summary.
    `origin`: the source's URL where `iter_dir` is its local copy (the manifest records it)."""
    import dataclasses

    started = time.perf_counter()
    plan = plan_conversion(iter_dir, extra_argv)
    if origin:
        plan = dataclasses.replace(plan, head=dataclasses.replace(plan.head, source={"fsdp_dtensor": origin}))
    reader = DcpReader(iter_dir)
    metas = {n: TensorEntry.new(n, e.shape, e.padded_rows is not None, e.padding_rows, e.states, e.buffer)
             for n, e in plan.atomics.items()}

    def opener(name):
        entry = plan.atomics[name]
        return lambda state: from_boxes(entry, reader, plan.prefixes[state], suffix(state))

    try:
        return stream_write.write_checkpoint(output_dir, plan.iteration, metas, opener, plan.head, {},
                                             workers, progress, started)
    finally:
        reader.close()
