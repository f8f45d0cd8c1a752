"""Export a universal checkpoint (saved on any layout) as a Hugging Face model folder (CPU only).

    python tools/export_hf.py CKPT OUT [--iteration N] [--dtype fp32|bf16] [--max-shard-gb G] [--no-progress]

CKPT is a save folder (its tracker's iteration, or --iteration) or one iter_ folder. OUT gets
config.json, generation_config.json and model.safetensors (or model-0000x-of-0000y.safetensors
shards with model.safetensors.index.json). Llama, Qwen2 and Mixtral computations only: a model
that no one of them computes alike is refused, naming the difference. Vocabulary padding rows
are dropped. See megatron_ucp/convert/hf.py and hf_map.py.
"""

import argparse
import os
import sys

try:
    import megatron_ucp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.errors import run_command  # noqa: E402


def main(argv=None) -> int:
    from megatron_ucp.convert.hf import export

    p = argparse.ArgumentParser(prog="export_hf", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="universal save folder or iter_ folder")
    p.add_argument("output", help="the Hugging Face model folder to write (new or empty)")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard")
    p.add_argument("--no-verify", action="store_true", help="skip the block checksums of the tensors read")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    s = export(a.checkpoint, a.output, a.iteration, a.dtype, a.max_shard_gb * 1e9,
               not a.no_progress, not a.no_verify)
    print(f"exported iteration {s['iteration']} as {s['family']}: {s['tensors']} tensors in {s['files']} "
          f"files, {s['bytes'] / 1e9:.3f} GB in {s['seconds']:.1f} s ({s['GB/s']:.3f} GB/s) into {s['output']}")
    return 0


if __name__ == "__main__":
    run_command(main, "export_hf")
