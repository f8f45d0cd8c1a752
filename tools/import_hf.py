"""Import a Hugging Face model folder (Llama, Qwen2, Mixtral; safetensors) as a universal
checkpoint at iteration 0 holding the weights only (CPU only).

    python tools/import_hf.py HF_DIR OUT [--workers N] [--no-progress]

It prints the pretrain_gpt_ucp.py model flags that build the matching megatron model; train from
it on any layout with `--load OUT --finetune` (the manifest stores those flags, so
`--use-checkpoint-args` works too). See megatron_ucp/convert/hf.py and hf_map.py.
"""

import argparse
import os
import sys

try:
    import megatron_ucp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.errors import ConfigError, run_command  # noqa: E402


def main(argv=None) -> int:
    from megatron_ucp.convert.hf import import_

    p = argparse.ArgumentParser(prog="import_hf", description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", help="Hugging Face model folder (config.json and safetensors)")
    p.add_argument("output", help="where the universal checkpoint goes")
    p.add_argument("--workers", type=int, default=1, help="write this many atomic tensors in parallel processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {a.workers}")
    s = import_(a.hf_dir, a.output, not a.no_progress, a.workers)
    print(f"imported {s['family']}: {s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB in {s['seconds']:.1f} s "
          f"({s['GB/s']:.3f} GB/s) into {s['output']}")
    print("model flags: " + " ".join(s["megatron_args"]))
    return 0


if __name__ == "__main__":
    run_command(main, "import_hf")
