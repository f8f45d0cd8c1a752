"""examples/cpu_demo.py's plot of the two loss curves: a PNG of the size it promises. Needs
matplotlib (an optional dependency): skipped, and reported as skipped, without it."""

import importlib.util
import struct

import pytest

from harness import REPO


def _demo():
    spec = importlib.util.spec_from_file_location("cpu_demo", REPO / "examples" / "cpu_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_writes_a_png_of_both_curves(tmp_path):
    pytest.importorskip("matplotlib")
    loss_a = {i: 7.0 - 0.1 * i for i in range(1, 21)}
    loss_b = {i: loss_a[i] + 1e-7 for i in range(11, 21)}
    path = tmp_path / "loss_curves.png"
    assert _demo().plot_losses(loss_a, loss_b, 10, path) is True
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (800, 450)


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    """An import of matplotlib that fails: no file, False (main then prints that it skipped)."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = tmp_path / "loss_curves.png"
    assert _demo().plot_losses({1: 1.0}, {1: 1.0}, 1, path) is False
    assert not path.exists()
