"""CPU quick-start: train a small GPT on one parallel layout, save a universal checkpoint,
resume on a different layout, and print both loss curves side by side (and plot them, in
loss_curves.png beside the checkpoints, when matplotlib is installed).

    python examples/cpu_demo.py [--workdir DIR] [--iters 20] [--save-at 10]

Run A trains with tensor parallelism 2 and the distributed optimizer (2 processes) for
--iters iterations, saving at --save-at; run B resumes that checkpoint on 2 processes with
pipeline parallelism 2 instead (a layout megatron-core's own checkpoint cannot load into).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = [
    "--cpu", "--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "1000",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--ckpt-format", "universal",
]
# Megatron-LM's trainer (megatron-core >= 0.17) has no defaults for these (README, "Which trainer").
MEGATRON_LM = ["--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--eval-interval", "1000"]
LAYOUT_A = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
LAYOUT_B = ["--pipeline-model-parallel-size", "2"]


def torchrun(nproc: int, argv: list, log: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(REPO / "pretrain_gpt_ucp.py")] + argv + ["--loss-log", str(log)]
    if ships_megatron_lm():
        cmd += MEGATRON_LM
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    print("$ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, env=env)


def ships_megatron_lm() -> bool:
    from megatron_ucp.mcore.compat import ships_megatron_lm as ships

    return ships()


def trainer() -> str:
    import megatron.core

    return (f"Megatron-LM's, with universal checkpoints plugged in (megatron-core {megatron.core.__version__})"
            if ships_megatron_lm() else
            f"the project's own loop (megatron-core {megatron.core.__version__})")


def read_log(path: Path) -> dict:
    return {r["iteration"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def plot_losses(loss_a: dict, loss_b: dict, save_at: int, path: Path) -> bool:
    """Both loss curves in one PNG (800 x 450 pixels); False when matplotlib is not installed,
    an optional dependency: the table above says the same."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)  # the Agg backend, without pyplot's global state
    ax = fig.add_subplot()
    ax.plot(sorted(loss_a), [loss_a[i] for i in sorted(loss_a)], "-o", ms=3, label="A: TP2 (uninterrupted)")
    ax.plot(sorted(loss_b), [loss_b[i] for i in sorted(loss_b)], "x", ms=7,
            label=f"B: PP2 (resumed from iteration {save_at})")
    ax.axvline(save_at, color="gray", ls=":", lw=1)
    ax.set(xlabel="iteration", ylabel="lm loss", title="universal checkpoint: resume on another layout")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--save-at", type=int, default=10)
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ucp-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoints"
    log_a, log_b = work / "loss_a.jsonl", work / "loss_b.jsonl"
    for f in (log_a, log_b):
        f.unlink(missing_ok=True)

    print(f"== trainer: {trainer()}")
    print(f"== run A: TP2 + distributed optimizer, {a.iters} iterations, universal save at {a.save_at}")
    torchrun(2, MODEL + LAYOUT_A + ["--train-iters", str(a.iters), "--save", str(ckpt),
                                    "--save-interval", str(a.save_at), "--log-interval", "5"], log_a)
    print(f"== run B: resume iteration {a.save_at} on PP2 (a different layout)")
    torchrun(2, MODEL + LAYOUT_B + ["--train-iters", str(a.iters), "--load", str(ckpt),
                                    "--ckpt-step", str(a.save_at), "--log-interval", "5"], log_b)

    loss_a, loss_b = read_log(log_a), read_log(log_b)
    print("\n iteration |  A: TP2 (uninterrupted) |  B: PP2 (resumed) |   |A - B|")
    print("-----------+-------------------------+-------------------+-----------")
    for it in sorted(loss_a):
        b = loss_b.get(it)
        right = f"{b:17.6f} | {abs(loss_a[it] - b):9.2e}" if b is not None else f"{'':17} |"
        print(f" {it:9d} | {loss_a[it]:23.6f} | {right}")
    worst = max(abs(loss_a[i] - loss_b[i]) for i in loss_b)
    print(f"\nmax |A - B| over the {len(loss_b)} resumed iterations: {worst:.2e}; checkpoints in {ckpt}")
    png = work / "loss_curves.png"
    if plot_losses(loss_a, loss_b, a.save_at, png):
        print(f"loss curves plotted in {png}")
    else:
        print("matplotlib is not installed: the PNG of the loss curves was skipped")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
