"""Hugging Face export and import commands (CPU only), over megatron_ucp.convert.hf.

    megatron-ucp export-hf CKPT OUT [--iteration N] [--dtype fp32|bf16] [--max-shard-gb G] [--no-progress]
    megatron-ucp import-hf HF_DIR OUT [--workers N] [--no-progress] [--no-proof]

Export: CKPT is a save folder (its tracker's iteration, or --iteration) or one iter_ folder. OUT
gets config.json, generation_config.json and model.safetensors (or model-0000x-of-0000y.safetensors
shards with model.safetensors.index.json). Llama, Qwen2 and Mixtral computations only: a model
that no one of them computes alike is refused, naming the difference. Vocabulary padding rows
are dropped.

Import: a Hugging Face folder of those families (safetensors) becomes a universal checkpoint at
iteration 0 holding the weights only; it prints the training flags that build the matching
megatron model; train from it on any layout with `--load OUT --finetune` (the manifest stores
those flags, so `--use-checkpoint-args` works too). It records the resume proof of the source
(transformers' losses of a probe sequence on CPU, convert/hf_proof.py): the first load refuses a
checkpoint whose model computes something else. See megatron_ucp/convert/hf.py and hf_map.py.
"""

import argparse



def export_main(argv=None) -> int:
    from megatron_ucp.convert.hf import export

    p = argparse.ArgumentParser(prog="export_hf", description="Export a universal checkpoint "
                                "(saved on any layout) as a Hugging Face model folder (CPU only).")
    p.add_argument("checkpoint", help="universal save folder or iter_ folder")
    p.add_argument("output", help="the Hugging Face model folder to write (new or empty), or an empty "
                   "s3:// or msc:// prefix (written in a staging folder, then uploaded)")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard")
    p.add_argument("--no-verify", action="store_true", help="skip the block checksums of the tensors read")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--staging-dir", default=None, help="for an output in an object store: the local folder "
                   "the model folder is written in before its upload (default TMPDIR)")
    a = p.parse_args(argv)
    s = export(a.checkpoint, a.output, a.iteration, a.dtype, a.max_shard_gb * 1e9,
               not a.no_progress, not a.no_verify, a.staging_dir)
    print(f"exported iteration {s['iteration']} as {s['family']}: {s['tensors']} tensors in {s['files']} "
          f"files, {s['bytes'] / 1e9:.3f} GB in {s['seconds']:.1f} s ({s['GB/s']:.3f} GB/s) into {s['output']}")
    return 0


def import_main(argv=None) -> int:
    from megatron_ucp.convert.hf import import_

    from megatron_ucp.convert.import_args import import_parser, parse_import_args

    p = import_parser("import_hf", "Import a Hugging Face model folder (Llama, Qwen2, Mixtral; "
                      "safetensors) as a universal checkpoint at iteration 0 holding the weights only "
                      "(CPU only).", "hf_dir", "Hugging Face model folder (config.json and safetensors)")
    p.add_argument("--no-proof", action="store_true",
                   help="skip recording the resume proof (transformers' losses of a probe sequence on CPU, which "
                        "the first resume compares with megatron's)")
    a = parse_import_args(p, argv)
    s = import_(a.hf_dir, a.output, not a.no_progress, a.workers, not a.no_proof, a.staging_dir)
    print(f"imported {s['family']}: {s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB in {s['seconds']:.1f} s "
          f"({s['GB/s']:.3f} GB/s) into {s['output']}")
    print(f" {s['proof']}")
    print("model flags: " + " ".join(s["megatron_args"]))
    return 0

