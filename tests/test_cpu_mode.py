"""CPU mode is opt-in: without --cpu nothing of megatron_ucp.mcore.cpu_mode is imported or patched."""

import subprocess
import sys
import textwrap

from harness import REPO

PROBE = textwrap.dedent("""
    import sys, torch
    original = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.Tensor.type)
    from megatron_ucp.train.loop import pretrain
    try:
        pretrain({argv})
        outcome = "trained"
    except Exception as e:
        outcome = type(e).__name__
    import megatron.core.tensor_parallel.random as random
    patched = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.Tensor.type)
    print("OUTCOME", outcome)
    print("IMPORTED", "megatron_ucp.mcore.cpu_mode" in sys.modules)
    print("PATCHED", any(a is not b for a, b in zip(original, patched)))
    print("TRACKER", random.CudaRNGStatesTracker.__module__)
""")


def probe(argv):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0].isupper())
    assert "OUTCOME" in out, proc.stderr[-3000:]
    return out


def test_gpu_path_never_touches_cpu_mode():
    out = probe(["--mock-data", "--train-iters", "1"])
    assert out["OUTCOME"] != "trained"  # no GPU here: it fails at CUDA, as a GPU job would without one
    assert out["IMPORTED"] == "False"
    assert out["PATCHED"] == "False"
    assert out["TRACKER"] == "megatron.core.tensor_parallel.random"


def test_cpu_flag_enables_it():
    out = probe(["--cpu", "--mock-data", "--train-iters", "1", "--num-layers", "2",
                 "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"])
    assert out["OUTCOME"] == "trained"
    assert out["IMPORTED"] == "True"
    assert out["PATCHED"] == "True"
    assert out["TRACKER"] == "megatron_ucp.mcore.cpu_mode"


COALESCING = textwrap.dedent("""
    import importlib, torch, torch.distributed as dist
    from megatron_ucp.mcore import cpu_mode
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_mode.enable()
    for name in ("megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer", "torch.distributed"):
        shard, gathered = torch.arange(4.0), torch.zeros(4)
        with importlib.import_module(name)._coalescing_manager(async_ops=True) as handle:
            dist.all_gather_into_tensor(gathered, shard, async_op=True)
        print("GATHER", name, len(handle.works), bool(torch.equal(gathered, shard)))
""")


def test_coalesced_collectives_run_synchronously_on_cpu():
    """gloo's asynchronous coalesced all-gather corrupts the heap now and then
    (benchmarks/gloo_coalesced_allgather.py): under CPU mode megatron's coalescing managers finish
    their collectives before they exit, and hand back handles with nothing left to wait for."""
    from harness import free_port

    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", COALESCING.format(port=free_port())], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)
    gathers = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("GATHER")]
    assert len(gathers) == 3, proc.stderr[-3000:]
    assert all(works == "0" and done == "True" for _, works, done in gathers), gathers


def test_the_trainers_cpu_mode_names_each_flag_it_ignores():
    """`--fp8-format hybrid` and `--attention-backend fused` ran on CPU, exited 0 and changed
    nothing (losses bit-identical): each gets a line at start-up (megatron_lm/cpu.py)."""
    import argparse
    import enum

    from megatron_ucp.megatron_lm.cpu import ignored_flags

    backend = enum.Enum("AttnBackend", "flash fused unfused local auto")
    quiet = argparse.Namespace(transformer_impl="local", fp8=None, fp4=None, fp8_param_gather=False,
                               attention_backend=backend.auto, use_flash_attn=False)
    assert ignored_flags(quiet) == []
    loud = argparse.Namespace(**{**vars(quiet), "fp8": "hybrid", "attention_backend": backend.fused})
    lines = ignored_flags(loud)
    assert len(lines) == 2 and all(line.startswith("WARNING: --cpu ignores --") for line in lines), lines
    assert "--fp8-format" in lines[0] and "(hybrid given)" in lines[0]
    assert "--attention-backend" in lines[1] and "(fused given)" in lines[1]
    assert ignored_flags(argparse.Namespace(**{**vars(loud), "transformer_impl": "transformer_engine"})) == []
