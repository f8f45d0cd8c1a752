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
