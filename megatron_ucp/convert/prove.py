"""A checkpoint's resume proof in one CPU process, outside any training job.

- `check(root, iteration)`: `inspect --verify --prove`: the universal checkpoint loaded into a
  one-process model built from its stored arguments, its resume proof recomputed there (the
  load checks it, engine/proof.py): a CI-sized check that a folder is the model it claims to be.
- `record_from_source(...)`: the proof of a converted checkpoint, computed from megatron's own
  load of the SOURCE (torch_dist, in one process: megatron reshards it; legacy torch in its
  layout; fsdp_dtensor by Megatron-LM's trainer and Megatron-FSDP), written into the
  converted manifest: a wrong mapping of the streaming converter is caught at the first resume
  on any layout (the converted weights compute other losses, their digests differ).
Both run the training application's worker (train/workers.py `prove`) through launch.run_workers,
fsdp_dtensor Megatron-LM's trainer's (megatron_lm/prove_source.py, megatron-core >= 0.17).
"""

import json
import os
import tempfile

from megatron_ucp.errors import ConfigError, FormatError

# What the one process holds: the model, its fp32 master weights and Adam's moments, and
# megatron's buffers beside them; refused up front where the machine has less free memory.
_STATE_FACTOR = 3


def _fits(nbytes: int, where: str) -> None:
    import psutil

    free = psutil.virtual_memory().available
    if nbytes * _STATE_FACTOR > free:
        raise ConfigError(f"{where}: the proof loads the whole model in one process: about "
                          f"{nbytes * _STATE_FACTOR / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available")


def _model_argv(saved: dict, manifest, path: str) -> list:
    from megatron_ucp.convert.export_torch_dist import carried_argv, carried_names
    from megatron_ucp.mcore import saved_args

    if not saved:
        raise FormatError(f"{path}: the manifest stores no training arguments: the proof needs them to "
                          "build the model")
    saved_args.check(saved, carried_names(), manifest, path)
    return carried_argv(saved) + ["--cpu", "--mock-data"]


def _run(kind_argv: list, model_argv: list, nproc: int = 1, python: str = None) -> dict:
    """The training application's `prove` worker, or with `python` (an interpreter of
    megatron-core >= 0.17) Megatron-LM's trainer's (megatron_lm/prove_source.py)."""
    from megatron_ucp.convert.launch import run_workers

    with tempfile.TemporaryDirectory(prefix="ucp-prove-") as tmp:
        out = os.path.join(tmp, "proof.json")
        if python is None:
            code = run_workers(nproc, "megatron_ucp.train.workers",
                               ["prove", *kind_argv, "--out", out, "--", *model_argv])
        else:
            code = run_workers(nproc, "megatron_ucp.megatron_lm.prove_source", ["--out", out, "--", *model_argv],
                               python)
        if not os.path.exists(out):
            raise FormatError(f"the proof's worker failed (exit code {code}) before it could say why"
                              + _last_words(out + ".log"))
        with open(out) as f:
            return json.load(f)


def _last_words(log: str) -> str:
    """The last line of the trainer's log (prove_source.py keeps its output there), if any."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f.read()[-4096:].splitlines() if line.strip()]
    except OSError:
        return ""
    return f"; its log ends: {lines[-1][:300]}" if lines else ""


def trainer_python() -> str:
    """An interpreter whose megatron-core ships Megatron-LM's trainer (0.17 and later): this one,
    else UCP_OTHER_PYTHON's (the 0.16 install's companion, README "Which trainer")."""
    import sys

    from megatron_ucp.mcore.compat import ships_megatron_lm

    if ships_megatron_lm():
        return sys.executable
    other = os.environ.get("UCP_OTHER_PYTHON")
    if other and not (os.path.isfile(other) and os.access(other, os.X_OK)):
        raise ConfigError(f"UCP_OTHER_PYTHON={other}: no such executable (expected the python of a megatron-core "
                          ">= 0.17 install, which ships Megatron-LM's trainer)")
    if other:
        return other
    raise ConfigError("Megatron-LM's trainer is not installed here (megatron-core >= 0.17 ships it; set "
                      "UCP_OTHER_PYTHON to the python of such an install)")


def check(root: str, iteration: int) -> dict:
    """{"ok": bool, "line": what the load said}: the universal checkpoint's resume proof
    recomputed in one CPU process."""
    from megatron_ucp.format.folder import iteration_dir
    from megatron_ucp.format.manifest import MANIFEST, read_manifest

    directory = iteration_dir(root, iteration)
    m = read_manifest(directory)
    path = os.path.join(directory, MANIFEST)
    _fits(sum(e.file_size or 0 for e in m.tensors.values()), directory)
    argv = _model_argv(m.args if isinstance(m.args, dict) else {}, m, path)
    # --load: the session keeps the checkpoint's padded vocabulary, as a resume does
    argv += ["--load", root, "--ckpt-step", str(iteration), "--load-universal"]
    argv += ([] if m.optimizer else ["--no-load-optim"]) + ([] if m.rng_saved else ["--no-load-rng"])  # an import
    return _run(["--source", root, "--iteration", str(iteration), "--format", "universal"], argv)


def record_from_source(source_root: str, iteration: int, output_dir: str, model_argv: list, fmt: str = "torch_dist",
                       nproc: int = 1, tp: int = 1, python: str = None, load_optim: bool = False) -> str:
    """The proof of megatron's own load of the source checkpoint (weights only), written into
    the converted checkpoint's manifest; returns the line to print. torch_dist: one process
    (megatron reshards); legacy `torch`: `nproc` processes of the source's layout (its files
    load only there), whose layout flags `model_argv` carries (`tp`: its TP size);
    `fsdp_dtensor`: Megatron-LM's trainer under `python` (trainer_python), `model_argv` its
    flags with `--load`, in one process (megatron's DCP load reshards). `load_optim`: the
    optimizer state too (Megatron-FSDP's 16-bit runs load their weights only with it), whose
    moments the proof then digests as well."""
    from megatron_ucp.format.durability import atomic_write_json
    from megatron_ucp.format.folder import iteration_dir
    from megatron_ucp.format.manifest import MANIFEST, read_manifest

    out_dir = iteration_dir(output_dir, iteration)
    converted = read_manifest(out_dir)
    _fits(sum(e.file_size or 0 for e in converted.tensors.values()), out_dir)
    padding = []
    padded = converted.layout.get("padded_vocab_size")
    if padded:  # the source's padded vocabulary (padding rows take part in the probe's softmax)
        padding = ["--make-vocab-size-divisible-by", str(padded // tp)]
    result = _run(["--source", source_root, "--iteration", str(iteration), "--format", fmt],
                  list(model_argv) + padding + ["--cpu", "--mock-data", "--no-load-rng"]
                  + ([] if load_optim else ["--no-load-optim"]), nproc, python)
    if "proof" not in result:
        return f"resume proof not recorded: {result.get('line')}"
    manifest = dict(converted.to_json(), proof=result["proof"])
    atomic_write_json(os.path.join(out_dir, MANIFEST), manifest)
    return (f"resume proof recorded from megatron's own load of the source: "
            f"{result['proof']['probe']['tokens']} probe tokens, {len(result['proof']['digests'])} "
            f"{'state' if load_optim else 'weight'} digests")


def layout_argv(layout: dict, num_layers: int) -> list:
    """The flags of a saved layout (a legacy checkpoint loads only on its own)."""
    argv = ["--tensor-model-parallel-size", str(layout["tensor_model_parallel_size"]),
            "--pipeline-model-parallel-size", str(layout["pipeline_model_parallel_size"])]
    vpp = layout.get("virtual_pipeline_model_parallel_size")
    if vpp:
        argv += ["--num-layers-per-virtual-pipeline-stage",
                 str(num_layers // (vpp * layout["pipeline_model_parallel_size"]))]
    return argv
