"""Universal checkpoints in Megatron-Bridge (issue 51): Bridge's own `pretrain()` with only
`checkpoint.custom_manager_class = "megatron_ucp.bridge.UniversalCheckpointManager"` set
(examples/bridge_gpt.py, 2 CPU processes over gloo), saved on one layout and resumed on another
with the uninterrupted run's losses within 1e-4 (fp32).

Bridge runs on megatron-core 0.19 (the interpreter mlm_harness.trainer_python finds) with
megatron-bridge 0.6.2 from REPO/.bridge-libs (`bash run.sh setup-bridge`; UCP_BRIDGE_LIBS names
another folder). Without it the tests skip; with UCP_REQUIRE_BRIDGE=1 (CI) they fail instead.

The example's GPT is tests/mlm_harness.BASE's (same model, padding, data, optimizer): Megatron-LM's
trainer and Bridge compute the same losses, so checkpoints move between them with equal losses.

CI time: one reference run (TP1 x DP2, distributed optimizer, 8 iterations, universal saves at
4 and 8) is shared by the module; by default only its resume on TP2 x DP1 runs beside it (about
a minute on an idle 2-core machine). The other directions and Bridge's torch_dist continuation
are marked slow (run by hand: `pytest -m slow tests/test_bridge.py`), each one more run or two.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import launch
from harness import REPO, free_port
from megatron_ucp.megatron_lm import loss_log

EXAMPLE = REPO / "examples" / "bridge_gpt.py"
TOLERANCE = 1e-4


def bridge_libs() -> Path:
    return Path(os.environ.get("UCP_BRIDGE_LIBS") or REPO / ".bridge-libs")


@pytest.fixture(scope="module")
def python():
    """The 0.19 interpreter that imports Megatron-Bridge from bridge_libs(), or skip (fail
    under UCP_REQUIRE_BRIDGE=1)."""
    from mlm_harness import trainer_python

    message = None
    try:
        interpreter = trainer_python()
    except pytest.skip.Exception as e:
        interpreter, message = None, str(e)
    if interpreter is not None:
        proc = subprocess.run([interpreter, "-c", "import megatron_ucp.bridge"], capture_output=True, text=True,
                              timeout=300, env=_env())
        if proc.returncode == 0:
            return interpreter
        message = (f"Megatron-Bridge does not import from {bridge_libs()} ({proc.stderr.strip().splitlines()[-1:]}); "
                   "`bash run.sh setup-bridge` installs it (README 'Megatron-Bridge')")
    if os.environ.get("UCP_REQUIRE_BRIDGE") == "1":
        pytest.fail(f"UCP_REQUIRE_BRIDGE=1 but {message}")
    pytest.skip(message)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(bridge_libs())]),
               UCP_INLINE_HASH_BYTES="1")
    return env


class Run:
    def __init__(self, workdir: Path, output: str):
        self.workdir, self.output = workdir, output

    def losses(self) -> dict:
        path = self.workdir / "loss.jsonl"
        return loss_log.read(path) if path.exists() else {}

    def consumed(self) -> dict:
        """{iteration: consumed samples} from Bridge's own log lines."""
        found = re.findall(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)", self.output)
        return {int(i): int(n) for i, n in found}


def bridge_run(python: str, workdir: Path, *args, nproc: int = 2, timeout: int = 600) -> Run:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "loss.jsonl").unlink(missing_ok=True)
    argv = [str(EXAMPLE), "--cpu", "--loss-log", str(workdir / "loss.jsonl"), *map(str, args)]
    proc = launch.run_group(python, nproc, argv, _env(), workdir, free_port(), timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"Bridge run failed ({proc.returncode}): {' '.join(argv)}\n{output[-8000:]}"
    return Run(workdir, output)


def assert_resumed(reference: Run, resumed: Run, iterations) -> float:
    ref, got = reference.losses(), resumed.losses()
    missing = [i for i in iterations if i not in ref or i not in got]
    assert not missing, f"iterations {missing} missing (reference {sorted(ref)}, resumed {sorted(got)})"
    assert min(got) == min(iterations), f"the resumed run started at {min(got)}, not {min(iterations)}"
    delta = max(abs(ref[i] - got[i]) for i in iterations)
    assert delta <= TOLERANCE, f"losses differ by {delta}: reference {ref}, resumed {got}"
    return delta


def train_state(folder: Path) -> dict:
    """Bridge's train_state.pt beside a checkpoint (written by the manager), as plain numbers."""
    import torch

    return {k: v.item() for k, v in torch.load(folder / "train_state.pt", weights_only=True).items()}


@pytest.fixture(scope="module")
def reference(python, tmp_path_factory):
    """TP1 x DP2 with the distributed optimizer, 8 iterations, universal saves at 4 and 8."""
    workdir = tmp_path_factory.mktemp("bridge_reference")
    return bridge_run(python, workdir, "--tp", 1, "--iters", 8, "--save", workdir / "ckpt")


def test_universal_save_keeps_bridge_side_files(reference):
    ckpt = reference.workdir / "ckpt"
    folder = ckpt / "iter_0000004"
    assert (folder / "ucp.json").exists() and (folder / "run_config.yaml").exists()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    state = train_state(folder)
    assert state["step"] == 4 and state["consumed_train_samples"] == 32, state
    assert state["floating_point_operations_so_far"] > 0
    latest = {k: v.item() for k, v in __import__("torch").load(ckpt / "latest_train_state.pt", weights_only=True).items()}
    assert latest["step"] == 8, latest
    manifest = json.loads((folder / "ucp.json").read_text())
    assert manifest["progress"]["num_floating_point_operations_so_far"] == state["floating_point_operations_so_far"]


def test_tp1dp2_resumes_on_tp2(python, reference, tmp_path):
    """Saved on TP1 x DP2 (distributed optimizer), resumed on TP2 x DP1: iterations 5-8 as the
    uninterrupted run's, Bridge's consumed samples and FLOPs carried on."""
    resumed = bridge_run(python, tmp_path, "--tp", 2, "--iters", 8, "--load", reference.workdir / "ckpt",
                         "--ckpt-step", 4, "--save", tmp_path / "ckpt")
    assert_resumed(reference, resumed, range(5, 9))
    assert resumed.consumed()[5] == 40, resumed.consumed()
    ours, theirs = train_state(tmp_path / "ckpt" / "iter_0000008"), train_state(reference.workdir / "ckpt" / "iter_0000008")
    assert ours == theirs, (ours, theirs)


@pytest.mark.slow  # one more Bridge run (~40 s): CI runs the TP1xDP2 -> TP2 direction above
def test_tp2_resumes_on_tp1dp2(python, reference, tmp_path):
    """TP2 x DP1 saved at 6 (stopped there by exit_interval; itself resumed from the reference's 4), resumed on TP1 x DP2 with
    the distributed optimizer: iterations 7-8 as the uninterrupted run's."""
    tp2 = bridge_run(python, tmp_path / "tp2", "--tp", 2, "--iters", 8, "--exit-interval", 6, "--load", reference.workdir / "ckpt",
                     "--ckpt-step", 4, "--save", tmp_path / "tp2" / "ckpt")
    back = bridge_run(python, tmp_path / "back", "--tp", 1, "--iters", 8, "--load", tmp_path / "tp2" / "ckpt")
    assert_resumed(reference, tp2, range(5, 7))
    assert_resumed(reference, back, range(7, 9))


@pytest.mark.slow  # one more Bridge run (~40 s)
def test_resumes_on_pp2(python, reference, tmp_path):
    resumed = bridge_run(python, tmp_path, "--pp", 2, "--iters", 8, "--load", reference.workdir / "ckpt",
                         "--ckpt-step", 4)
    assert_resumed(reference, resumed, range(5, 9))


@pytest.mark.slow  # two more Bridge runs (~80 s)
def test_torch_dist_checkpoint_continues_as_universal(python, reference, tmp_path):
    """Bridge's own torch_dist checkpoint (the default manager) at 4: the universal manager loads it
    through Bridge's default manager and its next save is universal, itself resumable."""
    ckpt = tmp_path / "ckpt"
    first = bridge_run(python, tmp_path / "torch_dist", "--tp", 1, "--iters", 8, "--exit-interval", 4, "--save", ckpt,
                       "--format", "torch_dist")
    assert_resumed(reference, first, range(1, 5))
    assert not (ckpt / "iter_0000004" / "ucp.json").exists()
    continued = bridge_run(python, tmp_path / "continued", "--tp", 1, "--iters", 8, "--load", ckpt, "--save", ckpt)
    assert_resumed(reference, continued, range(5, 9))
    assert (ckpt / "iter_0000008" / "ucp.json").exists()
    assert train_state(ckpt / "iter_0000008")["step"] == 8


@pytest.mark.slow  # two more Bridge runs (~90 s)
def test_async_save_commits_and_resumes(python, reference, tmp_path):
    """checkpoint.async_save: the universal saves are written in the background and committed where
    Bridge finalizes its own (finalize_async_saves); the committed checkpoint resumes on TP2."""
    ckpt = tmp_path / "ckpt"
    first = bridge_run(python, tmp_path / "async", "--tp", 1, "--iters", 8, "--exit-interval", 6,
                       "--save-interval", 2, "--async-save", "--save", ckpt)
    assert_resumed(reference, first, range(1, 7))
    for step in (2, 4, 6):
        assert (ckpt / f"iter_{step:07d}" / "ucp.json").exists() and train_state(ckpt / f"iter_{step:07d}")["step"] == step
    resumed = bridge_run(python, tmp_path / "resumed", "--tp", 2, "--iters", 8, "--load", ckpt)
    assert_resumed(reference, resumed, range(7, 9))


@pytest.mark.slow  # one Megatron-LM run and two Bridge runs (~2 min)
def test_megatron_lm_checkpoint_resumes_in_bridge_and_back(python, reference, tmp_path):
    """A universal checkpoint of Megatron-LM's trainer (the plug-in, TP1 x DP2, distributed
    optimizer, the same tiny GPT: tests/mlm_harness.BASE) resumes in Bridge on TP2, whose universal
    checkpoint resumes in Megatron-LM's trainer on TP1 x DP2: every iteration as Bridge's
    uninterrupted run (the two trainers compute the same losses for the same model and data)."""
    from mlm_harness import run as mlm_run

    mlm_ckpt, bridge_ckpt = tmp_path / "mlm_ckpt", tmp_path / "bridge_ckpt"
    common = ["--use-distributed-optimizer", "--ckpt-format", "universal", "--save-interval", "4"]
    first = mlm_run(python, tmp_path / "mlm", 2, common + ["--save", str(mlm_ckpt), "--exit-interval", "4"], 8).check()
    assert_resumed(reference, first, range(1, 5))
    in_bridge = bridge_run(python, tmp_path / "bridge", "--tp", 2, "--iters", 8, "--exit-interval", 6,
                           "--load", mlm_ckpt, "--save", bridge_ckpt)
    assert_resumed(reference, in_bridge, range(5, 7))
    assert in_bridge.consumed()[5] == 40, in_bridge.consumed()
    back = mlm_run(python, tmp_path / "mlm_back", 2, common + ["--load", str(bridge_ckpt)], 8).check()
    assert_resumed(reference, back, range(7, 9))


@pytest.mark.slow  # two more Bridge runs (~80 s)
def test_moe_resumes_from_ep2_on_ep1(python, tmp_path):
    """A mixture of experts (4 experts with biases, alltoall dispatcher) saved on EP2 x DP2
    resumes on EP1 x DP2 (each rank holding all experts): iterations 5-8 as the uninterrupted run's."""
    moe = ("--num-experts", 4)
    reference = bridge_run(python, tmp_path / "ep2", "--ep", 2, *moe, "--iters", 8, "--save", tmp_path / "ckpt")
    resumed = bridge_run(python, tmp_path / "ep1", "--ep", 1, *moe, "--iters", 8, "--load", tmp_path / "ckpt",
                         "--ckpt-step", 4)
    assert_resumed(reference, resumed, range(5, 9))
