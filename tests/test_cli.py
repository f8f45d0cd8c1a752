"""The `megatron-ucp` command (megatron_ucp/cli.py): help, version, and every subcommand's bad
input as one line naming the tool, exit 2, the same as the checkout's tools/*.py print."""

import importlib
import subprocess
import sys

import pytest

from harness import REPO
from megatron_ucp import __version__, cli


def test_help_lists_every_command_with_a_line_and_an_example(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in cli.COMMANDS:
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
        assert len(lines[at].split()) > 2 and "e.g. " in lines[at + 1], out
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err  # no command: usage, exit 2


def test_the_readme_names_every_subcommand():
    """README's sentence on the `megatron-ucp` command lists each subcommand (it left out
    import-deepspeed and megatron-lm)."""
    readme = (REPO / "README.md").read_text()
    sentence = readme[readme.index("It installs one command, `megatron-ucp`"):]
    sentence = sentence[:sentence.index(";")]
    missing = [name for name in cli.COMMANDS if f"`{name}`" not in sentence]
    assert not missing, f"README's subcommand list lacks {missing}"


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"megatron-ucp {__version__} (")


def test_every_command_reaches_its_main():
    for name, (module, function, *_rest) in cli.COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), function)), name


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ucp: error: unknown command 'frobnicate'") and err.count("\n") == 1


@pytest.mark.parametrize("argv, line", [
    (["convert", "--input", "{missing}", "--output", "{out}"],
     "convert_to_universal: error: {missing}/latest_checkpointed_iteration.txt: no tracker file"),
    (["inspect", "{missing}"], "inspect_checkpoint: error: {missing}: neither a universal checkpoint"),
    (["export-hf", "{missing}", "{out}"], "export_hf: error: {missing}: neither a universal checkpoint"),
    (["import-hf", "{missing}", "{out}"], "import_hf: error: HF config {missing}/config.json is missing"),
    (["import-hf", "{missing}", "{out}", "--workers", "0"], "import_hf: error: --workers must be >= 1, got 0"),
    (["export-torch-dist", "{missing}", "{out}"], "export_torch_dist: error: {missing}: no such checkpoint folder"),
    (["import-deepspeed", "{missing}", "{out}"], "import_deepspeed: error: {missing}: no such folder"),
    (["megatron-lm", "--cpu", "{missing}"], "megatron_ucp.megatron_lm: error: {missing}: no such script"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, line):
    names = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out")}
    assert cli.main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line.format(**names)) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_bad_flags_exit_2(capsys):
    for argv in (["convert", "--no-such-flag"], ["inspect"], ["export-hf"], ["import-hf", "x"],
                 ["export-torch-dist"]):
        with pytest.raises(SystemExit) as exit_:  # argparse's usage and error, exit 2
            cli.main(argv)
        assert exit_.value.code == 2, argv
        assert "usage: " in capsys.readouterr().err, argv
    assert cli.main(["gpu-check", "--bogus"]) == 2
    assert capsys.readouterr().err == "usage: megatron-ucp gpu-check [--dry-run-on-cpu]\n"


def _stderr(*cmd, cwd):
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, [line for line in proc.stderr.splitlines() if ": error: " in line]


def test_train_and_a_tool_shim_say_what_the_checkout_scripts_say(tmp_path):
    """`megatron-ucp train` and pretrain_gpt_ucp.py; `megatron-ucp export-torch-dist` and
    tools/export_torch_dist.py: the same line, exit 2."""
    train = ["--cpu", "--mock-data", "--tensor-model-parallel-size", "2", "--train-iters", "2"]
    expected = ["pretrain_gpt_ucp.py: error: world size 1 is not divisible by --tensor-model-parallel-size (2) "
                "x --pipeline-model-parallel-size (1)"]
    assert _stderr("-m", "megatron_ucp", "train", *train, cwd=REPO) == (2, expected)
    assert _stderr(REPO / "pretrain_gpt_ucp.py", *train, cwd=tmp_path) == (2, expected)
    missing = tmp_path / "missing"
    expected = [f"export_torch_dist: error: {missing}: no such checkpoint folder"]
    assert _stderr(REPO / "tools" / "export_torch_dist.py", missing, tmp_path / "o", cwd=tmp_path) == (2, expected)
