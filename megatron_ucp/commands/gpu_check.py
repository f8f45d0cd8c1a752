"""The GPU path, checked in one command on one GPU (`megatron-ucp gpu-check`, or `bash run.sh
gpu-check` in a checkout), in under 10 minutes.

What CPU tests cannot show: transformer-engine's layer spec, its FusedAdam (step in the param
groups, lazy state, the precision-aware optimizer's bf16 moments), bf16 and fp16 over NCCL. Each
check trains a small GPT with `python -m megatron_ucp.train` and resumes it:

1. TE spec + TE FusedAdam + bf16 + distributed optimizer over NCCL: save at 5, resume at 5 on
   the same layout, losses equal to the uninterrupted run's;
2. the same with the precision-aware optimizer (bf16 moments, fp32 masters inside FusedAdam);
3. fp16 with the dynamic loss scaler: same-layout resume, scaler state in the manifest;
4. the GPU checkpoint to 2 CPU processes (local spec, TP2 over gloo) and back to the GPU;
5. Megatron-LM's own trainer through the plug-in (`-m megatron_ucp.megatron_lm`, megatron-core
   >= 0.17, a checkout's examples/megatron_lm/pretrain_gpt.py): TE spec, FusedAdam, bf16 and the
   distributed optimizer over NCCL save a universal checkpoint, which resumes in the same
   trainer on 2 CPU processes with TP2 (another layout), losses compared.

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


def pretrain(work: Path, name: str, nproc: int, argv: list, timeout: int = 240) -> dict:
    """Run the training entry under torchrun; return {iteration: loss} (from --loss-log)."""
    log = work / f"{name}.jsonl"
    argv = argv if "--cpu" in argv else GPU_FLAGS + argv
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(29400 + (hash(name) % 500)),
           "-m", "megatron_ucp.train", *MODEL, *argv, "--loss-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (work / f"{name}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode} after {time.time() - start:.0f} s; "
                           f"last output:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {r["iteration"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


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
    reference = {r["iteration"]: r["loss"] for r in
                 map(json.loads, (work / "te_bf16_full.jsonl").read_text().splitlines())}
    cpu_ckpt = str(work / "cpu_tp2")
    cpu = pretrain(work, "cpu_tp2", 2, ["--cpu", "--tensor-model-parallel-size", "2", *bf16,
                                        "--train-iters", "7", "--load", gpu, "--ckpt-step", str(K),
                                        "--load-universal", "--save", cpu_ckpt, "--save-interval", "7"],
                   timeout=300)
    back = pretrain(work, "gpu_back", 1, [*bf16, "--train-iters", str(N), "--load", cpu_ckpt,
                                          "--ckpt-step", "7", "--load-universal"])
    d_cpu, d_back = delta(reference, cpu), delta(reference, back)
    if max(d_cpu, d_back) > GPU_CPU_TOL:
        raise RuntimeError(f"max |dloss| GPU->CPU {d_cpu:.3g}, CPU->GPU {d_back:.3g} > {GPU_CPU_TOL}")
    return f"max |dloss| GPU->CPU TP2 {d_cpu:.3g}, back on the GPU {d_back:.3g}"


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_lm" / "pretrain_gpt.py"
MLM_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
             "--num-workers", "0", "--bf16", "--use-distributed-optimizer", "--ckpt-format", "universal",
             "--train-iters", str(N)]
CPU_TRAINER = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
               "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
               "--no-rope-fusion"]


def megatron_lm(work: Path, name: str, nproc: int, cpu: bool, argv: list, timeout: int = 300) -> dict:
    """The example script under Megatron-LM's trainer with the plug-in; {iteration: loss}."""
    log = work / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(29400 + (hash(name) % 500)),
           "-m", "megatron_ucp.megatron_lm", *(["--cpu"] if cpu else []), str(EXAMPLE), *MLM_MODEL,
           *(CPU_TRAINER if cpu else ["--transformer-impl", "transformer_engine"]), *argv]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", UCP_LOSS_LOG=str(log)),
                          capture_output=True, text=True, timeout=timeout, cwd=work)
    (work / f"{name}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}; last output:\n{(proc.stdout + proc.stderr)[-3000:]}")
    sums = {}
    for path in work.glob(f"{name}.jsonl.rank*"):
        for r in map(json.loads, path.read_text().splitlines()):
            loss, tokens = sums.get(r["iteration"], (0.0, 0))
            sums[r["iteration"]] = (loss + r["loss"], tokens + r["tokens"])
    return {i: loss / tokens for i, (loss, tokens) in sums.items()}


def megatron_lm_trainer(work, cpu_only: bool) -> str:
    from megatron_ucp.mcore.compat import core_version

    if core_version() < (0, 17):
        return f"SKIP  megatron-core {'.'.join(map(str, core_version()))} ships no Megatron-LM trainer"
    if not EXAMPLE.exists():
        return f"SKIP  {EXAMPLE} is not here (a checkout has it; an installed wheel does not)"
    ckpt = str(work / "mlm")
    full = megatron_lm(work, "mlm_full", 1, cpu_only, ["--save", ckpt, "--save-interval", str(K)])
    cpu = megatron_lm(work, "mlm_cpu_tp2", 2, True, ["--tensor-model-parallel-size", "2", "--load", ckpt,
                                                     "--ckpt-step", str(K)])
    d = delta(full, cpu)
    if d > GPU_CPU_TOL:
        raise RuntimeError(f"max |dloss| trainer GPU -> trainer CPU TP2 {d:.3g} > {GPU_CPU_TOL}")
    return f"max |dloss| Megatron-LM trainer (TE, bf16, NCCL) -> the trainer on CPU TP2 {d:.3g}"


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
         lambda: same_layout(work, "te_bf16_moments", [
             "--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
             "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
             "--no-store-param-remainders"])),
        ("fp16 + dynamic loss scaler, same-layout resume",
         lambda: same_layout(work, "te_fp16", ["--fp16", "--use-distributed-optimizer",
                                               "--initial-loss-scale", "1024", "--loss-scale-window", "2"])),
        ("GPU checkpoint -> 2 CPU processes (local spec, TP2, gloo) -> GPU", lambda: cpu_and_back(work)),
        ("Megatron-LM's trainer with the plug-in (TE, FusedAdam, bf16, NCCL) -> CPU TP2",
         lambda: megatron_lm_trainer(work, cpu_only=bool(GPU_FLAGS))),
    ]
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
