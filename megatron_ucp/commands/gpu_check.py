"""The GPU path, checked in one command on one GPU (`megatron-ucp gpu-check`, or `bash run.sh
gpu-check` in a checkout), in under 10 minutes.

What CPU tests cannot show: transformer-engine's layer spec, its FusedAdam (step in the param
groups, lazy state, the precision-aware optimizer's bf16 moments), bf16 and fp16 over NCCL. Each
check trains a small GPT with `python -m megatron_ucp.train` (on megatron-core >= 0.17 Megatron-LM's
trainer with the plug-in, on 0.16 the project's own loop) and resumes it:

1. TE spec + TE FusedAdam + bf16 + distributed optimizer over NCCL: save at 5, resume at 5 on
   the same layout, losses equal to the uninterrupted run's;
2. the same with the precision-aware optimizer (bf16 moments, fp32 masters inside FusedAdam);
3. fp16 with the dynamic loss scaler: same-layout resume, scaler state in the manifest;
4. the GPU checkpoint to 2 CPU processes (local spec, TP2 over gloo) and back to the GPU;
5. (megatron-core >= 0.17) the check-1 checkpoint resumed with context parallelism 2: on 2 CPU
   processes, and with transformer-engine's attention over NCCL where the machine has two GPUs;
6. (megatron-core >= 0.17) an untied bf16 GPU checkpoint resumed by Megatron-FSDP: on the GPU
   (its buffers, TE's layers, NCCL) and on 2 CPU processes (uneven row shards over gloo).

Prints one line per check and a summary; exits non-zero if any failed. Needs a machine with a
CUDA torch, transformer-engine and megatron-core installed (nothing is installed here).
`--dry-run-on-cpu` runs the same checks on CPU processes (the fused-Adam stand-in in place of
TE's FusedAdam, the local spec): it checks this script, not the GPU.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_ucp.megatron_lm import loss_log  # the --loss-log both trainers write

MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "500", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7",
         "--log-interval", "1000"]
N, K = 10, 5
GPU_SAME_LAYOUT_TOL = 0.0  # the same kernels on the same layout: bitwise
GPU_CPU_TOL = 5e-2  # bf16 on different kernels (TE/cuBLAS vs CPU), after a few steps


def preflight() -> list:
    problems = []
    try:
        import torch

        if not torch.cuda.is_available():
            problems.append("torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
    except ImportError:
        problems.append("torch is not installed")
    for module in ("transformer_engine", "megatron.core"):
        try:
            __import__(module)
        except Exception as e:
            problems.append(f"cannot import {module}: {e}")
    return problems


GPU_FLAGS = []  # what a "GPU" run adds: --cpu --fused-adam-standin for --dry-run-on-cpu


# What Megatron-LM's trainer needs beyond MODEL, whose defaults are the own loop's (README, "Which
# trainer"); on a GPU it takes transformer-engine's spec and FusedAdam by default, with --cpu the
# local spec and the FusedAdam stand-in (megatron_lm/flags.py, megatron_lm/cpu.py).
TRAINER = ["--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
           "--ckpt-format", "universal"]
# Not Megatron-LM's: its trainer loads any universal checkpoint universally and takes the stand-in
# with --cpu by itself; it has no --no-store-param-remainders (TE >= 2.1 stores remainders with the
# precision-aware optimizer, which the save refuses by name if it cannot read whole fp32 masters).
OWN_LOOP_ONLY = {"--load-universal", "--fused-adam-standin", "--no-store-param-remainders"}


def trainer_name() -> str:
    from megatron_ucp.mcore.compat import ships_megatron_lm

    return ("Megatron-LM's trainer with the plug-in (megatron-core >= 0.17)" if ships_megatron_lm()
            else "the project's own loop (megatron-core 0.16)")


def command_line(argv: list) -> list:
    """MODEL + `argv` for the trainer `python -m megatron_ucp.train` runs on this megatron-core."""
    from megatron_ucp.mcore.compat import ships_megatron_lm

    argv = argv if "--cpu" in argv else GPU_FLAGS + argv
    if not ships_megatron_lm():
        return MODEL + argv
    return MODEL + TRAINER + [a for a in argv if a not in OWN_LOOP_ONLY]


def pretrain(work: Path, name: str, nproc: int, argv: list, timeout: int = 240) -> dict:
    """Run the training entry under torchrun; return {iteration: loss} (from --loss-log)."""
    log = work / f"{name}.jsonl"
    from megatron_ucp.convert.launch import LOCAL_RENDEZVOUS

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *LOCAL_RENDEZVOUS,
           "-m", "megatron_ucp.train", *command_line(argv), "--loss-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (work / f"{name}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode} after {time.time() - start:.0f} s; "
                           f"last output:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return loss_log.read(log)


def stand_in_gap() -> str | None:
    """SKIP where the CPU dry run cannot stand in for TE: Megatron-LM's trainer (no
    --no-store-param-remainders flag) keeps TE >= 2.1's 16-bit master remainders, which the
    FusedAdam stand-in does not reproduce."""
    from megatron_ucp.mcore.compat import ships_megatron_lm

    if GPU_FLAGS and ships_megatron_lm():
        return ("SKIP  dry run: Megatron-LM's trainer stores TE's param remainders, which the "
                "FusedAdam stand-in does not reproduce (on a GPU this check runs)")
    return None


def delta(reference: dict, resumed: dict) -> float:
    if not resumed or any(i not in reference for i in resumed):
        raise RuntimeError(f"resumed iterations {sorted(resumed)} not all in the reference run")
    return max(abs(reference[i] - resumed[i]) for i in resumed)


def same_layout(work, name, argv, tol=GPU_SAME_LAYOUT_TOL) -> str:
    ckpt = str(work / name)
    full = pretrain(work, f"{name}_full", 1, argv + ["--train-iters", str(N), "--save", ckpt,
                                                     "--save-interval", str(K)])
    resumed = pretrain(work, f"{name}_resume", 1, argv + ["--train-iters", str(N), "--load", ckpt,
                                                          "--ckpt-step", str(K), "--load-universal"])
    d = delta(full, resumed)
    manifest = json.loads((work / name / f"iter_{K:07d}" / "ucp.json").read_text())
    step = manifest["optimizer"]["step"]
    if step != K:
        raise RuntimeError(f"the manifest records Adam step {step}, expected {K}")
    if d > tol:
        raise RuntimeError(f"max |dloss| {d:.3g} > {tol}")
    scaler = manifest["optimizer"].get("grad_scaler")
    return f"max |dloss| {d:.3g}, Adam step {step}" + (f", loss scaler {scaler}" if scaler else "")


def cpu_and_back(work) -> str:
    bf16 = ["--bf16", "--use-distributed-optimizer"]
    gpu = str(work / "te_bf16")  # saved by check 1
    reference = loss_log.read(work / "te_bf16_full.jsonl")
    cpu_ckpt = str(work / "cpu_tp2")
    # --exit-interval, not a shorter --train-iters: Megatron-LM's scheduler checks it on load.
    cpu = pretrain(work, "cpu_tp2", 2, ["--cpu", "--tensor-model-parallel-size", "2", *bf16,
                                        "--train-iters", str(N), "--exit-interval", "7",
                                        "--load", gpu, "--ckpt-step", str(K),
                                        "--load-universal", "--save", cpu_ckpt, "--save-interval", "7"],
                   timeout=300)
    back = pretrain(work, "gpu_back", 1, [*bf16, "--train-iters", str(N), "--load", cpu_ckpt,
                                          "--ckpt-step", "7", "--load-universal"])
    d_cpu, d_back = delta(reference, cpu), delta(reference, back)
    if max(d_cpu, d_back) > GPU_CPU_TOL:
        raise RuntimeError(f"max |dloss| GPU->CPU {d_cpu:.3g}, CPU->GPU {d_back:.3g} > {GPU_CPU_TOL}")
    return f"max |dloss| GPU->CPU TP2 {d_cpu:.3g}, back on the GPU {d_back:.3g}"


def context_parallel(work) -> str:
    """Check 1's checkpoint resumed on CP2 through Megatron-LM's trainer: on 2 CPU processes (the
    CPU mode's attention over gloo) and, where there are two GPUs, with transformer-engine's
    attention over NCCL (which takes one rank per GPU)."""
    import torch

    from megatron_ucp.mcore.compat import ships_megatron_lm

    if not ships_megatron_lm():
        return "SKIP  context parallelism is checked through Megatron-LM's trainer (megatron-core >= 0.17)"
    reference = loss_log.read(work / "te_bf16_full.jsonl")
    resume = ["--bf16", "--use-distributed-optimizer", "--context-parallel-size", "2", "--train-iters", str(N),
              "--load", str(work / "te_bf16"), "--ckpt-step", str(K), "--load-universal"]
    deltas = {"CPU CP2": delta(reference, pretrain(work, "cpu_cp2", 2, ["--cpu", *resume], timeout=300))}
    if not GPU_FLAGS and torch.cuda.device_count() >= 2:
        deltas["GPU CP2"] = delta(reference, pretrain(work, "gpu_cp2", 2, resume))
    found = ", ".join(f"{k} {v:.3g}" for k, v in deltas.items()) + \
        ("" if "GPU CP2" in deltas else ", GPU CP2 not run (one GPU)")
    if max(deltas.values()) > GPU_CPU_TOL:
        raise RuntimeError(f"max |dloss| {found} > {GPU_CPU_TOL}")
    return f"max |dloss| {found}"


def fully_sharded(work) -> str:
    """A bf16 checkpoint with untied embeddings (Megatron-FSDP needs them) resumed by Megatron-FSDP
    through Megatron-LM's trainer: on the GPU, and on 2 CPU processes (DP2)."""
    from megatron_ucp.mcore.compat import ships_megatron_lm

    if not ships_megatron_lm():
        return "SKIP  Megatron-FSDP is checked through Megatron-LM's trainer (megatron-core >= 0.17)"
    untied = ["--bf16", "--untie-embeddings-and-output-weights", "--train-iters", str(N)]
    ckpt = str(work / "te_bf16_untied")
    reference = pretrain(work, "te_bf16_untied_full", 1, untied + [
        "--use-distributed-optimizer", "--save", ckpt, "--save-interval", str(K)])
    resume = untied + ["--use-megatron-fsdp", "--load", ckpt, "--ckpt-step", str(K), "--load-universal"]
    deltas = {"GPU Megatron-FSDP": delta(reference, pretrain(work, "gpu_megatron_fsdp", 1, resume)),
              "CPU Megatron-FSDP DP2": delta(reference, pretrain(work, "cpu_megatron_fsdp", 2, ["--cpu", *resume],
                                                                 timeout=300))}
    found = ", ".join(f"{k} {v:.3g}" for k, v in deltas.items())
    if max(deltas.values()) > GPU_CPU_TOL:
        raise RuntimeError(f"max |dloss| {found} > {GPU_CPU_TOL}")
    return f"max |dloss| {found}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--dry-run-on-cpu"]:
        GPU_FLAGS.extend(["--cpu", "--fused-adam-standin"])
        print("gpu-check: dry run on CPU processes (checks the script, not the GPU)", flush=True)
    elif argv:
        print("usage: megatron-ucp gpu-check [--dry-run-on-cpu]", file=sys.stderr)
        return 2
    else:
        problems = preflight()
        if problems:
            print("gpu-check: cannot run here: " + "; ".join(problems), file=sys.stderr)
            return 2
        import torch
        import transformer_engine

        print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"transformer-engine {getattr(transformer_engine, '__version__', '?')}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="ucp_gpu_check_"))
    checks = [
        ("TE spec + FusedAdam + bf16 + distributed optimizer, same-layout resume",
         lambda: same_layout(work, "te_bf16", ["--bf16", "--use-distributed-optimizer"])),
        ("precision-aware optimizer (bf16 moments), same-layout resume",
         lambda: stand_in_gap() or same_layout(work, "te_bf16_moments", [
             "--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
             "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
             "--no-store-param-remainders"])),
        ("fp16 + dynamic loss scaler, same-layout resume",
         lambda: same_layout(work, "te_fp16", ["--fp16", "--use-distributed-optimizer",
                                               "--initial-loss-scale", "1024", "--loss-scale-window", "2"])),
        ("GPU checkpoint -> 2 CPU processes (local spec, TP2, gloo) -> GPU", lambda: cpu_and_back(work)),
        ("GPU checkpoint -> context parallelism 2 (CPU; TE over NCCL on two GPUs)",
         lambda: context_parallel(work)),
        ("GPU checkpoint -> Megatron-FSDP (GPU; 2 CPU processes)", lambda: fully_sharded(work)),
    ]
    print(f"gpu-check: every run is {trainer_name()}", flush=True)
    failed = 0
    for title, check in checks:
        start = time.time()
        try:
            result = check()
            result = result if result.startswith("SKIP") else f"PASS  {result}"
        except Exception as e:  # each check reports, the next one still runs
            failed += 1
            result = f"FAIL  {e}"
        print(f"[{time.time() - start:5.0f} s] {title}: {result}", flush=True)
    print(f"gpu-check: {len(checks) - failed} passed, {failed} failed (logs in {work})", flush=True)
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
