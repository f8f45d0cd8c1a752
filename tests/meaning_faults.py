"""Checkpoints whose bytes are intact but whose meaning is wrong: a tensor state rewritten in
place (safetensors data offsets from the file's own header) and every block checksum of the
file redone in the manifest, so that the CRCs, `inspect --verify` and the load's own checks all
pass. What only the resume proof (engine/proof.py) can catch."""

import json
import struct
from pathlib import Path

import numpy as np

from megatron_ucp.format import checksums


def _header(path: Path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


def read_state(ckpt: Path, name: str, state: str = "param") -> np.ndarray:
    path = ckpt / "tensors" / f"{name}.safetensors"
    base, header = _header(path)
    info = header[state]
    lo, hi = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + lo)
        return np.frombuffer(f.read(hi - lo), dtype=np.float32).reshape(info["shape"]).copy()


def write_state(ckpt: Path, name: str, state: str, value: np.ndarray) -> None:
    """`value` written over `state` of atomic tensor `name`, its checksums redone."""
    path = ckpt / "tensors" / f"{name}.safetensors"
    base, header = _header(path)
    lo, hi = header[state]["data_offsets"]
    data = np.ascontiguousarray(value, dtype=np.float32).tobytes()
    assert len(data) == hi - lo, (name, state)
    with open(path, "r+b") as f:
        f.seek(base + lo)
        f.write(data)
    manifest_path = ckpt / "ucp.json"
    m = json.loads(manifest_path.read_text())
    entry = m["tensors"][name]
    entry["checksums"] = checksums.block_checksums(str(path), base, path.stat().st_size, entry["block_bytes"])
    manifest_path.write_text(json.dumps(m))


def swap_key_rows(ckpt: Path, layer: int, heads: int, head_a: int = 0, head_b: int = 1) -> None:
    """Two heads' key rows of megatron's fused QKV weight swapped (MHA: per head group
    [q; k; v], each head_dim rows)."""
    name = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
    w = read_state(ckpt, name)
    hd = w.shape[0] // (3 * heads)
    ka = slice(head_a * 3 * hd + hd, head_a * 3 * hd + 2 * hd)
    kb = slice(head_b * 3 * hd + hd, head_b * 3 * hd + 2 * hd)
    w[ka], w[kb] = w[kb].copy(), w[ka].copy()
    write_state(ckpt, name, "param", w)


def moments_from(ckpt: Path, other: Path) -> None:
    """Every tensor's Adam moments replaced by another checkpoint's (another iteration)."""
    m = json.loads((ckpt / "ucp.json").read_text())
    for name, entry in m["tensors"].items():
        for state in ("exp_avg", "exp_avg_sq"):
            if state in entry["states"]:
                write_state(ckpt, name, state, read_state(other, name, state))


def tensor_from(ckpt: Path, other: Path, name: str) -> None:
    """One tensor's weight replaced by the same tensor of another model (another seed)."""
    write_state(ckpt, name, "param", read_state(other, name))
