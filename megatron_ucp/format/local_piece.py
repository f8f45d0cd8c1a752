"""The local tier's files: one rank's piece of a universal checkpoint on a node's local dir.

    DIR/<host>/iter_0000006/rank_00002.safetensors   # the regions rank 2 owns, every state
    DIR/<host>/iter_0000006/rank_00002.json          # its size and CRC-32, written after it
    DIR/<host>/iter_0000006/COMPLETE                 # every rank's piece and replicas written

A piece is a valid safetensors file (fp32 tensors "<item>.<state>", no pickle) whose metadata
holds its regions (atomic tensor, part, box, flat range), the saving rank's RNG state and, on
rank 0's, the manifest head: what a universal save would have written, so that pieces of any
layout assemble into a universal checkpoint folder that reshards on load. A node keeps its own
ranks' pieces (originals) and other nodes' replicas under the same names.
"""

import json
import os
import shutil
import struct
import zlib
from typing import Dict, List, Optional, Tuple

import numpy as np
from safetensors.numpy import save as st_save

from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError
from megatron_ucp.format.durability import atomic_write_bytes, atomic_write_json, fsync_dir
from megatron_ucp.format.folder import iteration_dir, iteration_of
from megatron_ucp.format.layout import Region
from megatron_ucp.format.safe_files import read_bounded, read_json

COMPLETE = "COMPLETE"
RESTORE = "restore"  # a node's assembled universal checkpoint, while a restart loads it
MAX_HEADER_BYTES = 256 * 2**20
MAX_SIDECAR_BYTES = 4096  # a sidecar or COMPLETE marker: a few integers as JSON


def piece_path(node_dir: str, iteration: int, rank: int) -> str:
    return os.path.join(iteration_dir(node_dir, iteration), f"rank_{rank:05d}.safetensors")


def encode(items: List[Tuple[str, Region]], arrays: List[Dict[str, np.ndarray]], meta: dict) -> bytes:
    """A piece's bytes: `arrays[i]` (state -> 1-D fp32) are region `items[i]`'s data."""
    tensors = {f"{i}.{state}": np.ascontiguousarray(a, dtype=np.float32)
               for i, states in enumerate(arrays) for state, a in states.items()}
    regions = [[name, r.part, list(r.offset), list(r.shape), r.start, r.stop] for name, r in items]
    return st_save(tensors, metadata={"ucp_local": json.dumps(dict(meta, regions=regions))})


def decode(data: bytes, path: str):
    """(meta, [(name, Region, {state: array})]) of a piece's bytes; FormatError names `path`."""
    from safetensors.numpy import load

    if len(data) < 8:
        raise FormatError(f"{path}: {len(data)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise FormatError(f"{path}: header length {n} does not fit the file of {len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n])
        meta = json.loads(header["__metadata__"]["ucp_local"])
        tensors = load(data)
        out = []
        for i, (name, part, offset, shape, start, stop) in enumerate(meta.pop("regions")):
            region = Region(part, tuple(offset), tuple(shape), int(start), int(stop))
            states = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
            out.append((name, region, states))
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: not a local-tier piece ({type(e).__name__}: {e})") from None
    return meta, out


def write_piece(node_dir: str, iteration: int, rank: int, data: bytes) -> None:
    """The piece, then its sidecar (size, CRC-32): a piece without a sidecar does not count."""
    path = piece_path(node_dir, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, data)
    atomic_write_json(path[: -len(".safetensors")] + ".json",
                      {"rank": rank, "iteration": iteration, "bytes": len(data), "crc32": zlib.crc32(data)})


def _sidecar(path: str) -> dict:
    """A piece's sidecar record (regular file, bounded, strict JSON): {"bytes": int, "crc32": int}."""
    record = read_json(path[: -len(".safetensors")] + ".json", "local-tier sidecar", MAX_SIDECAR_BYTES)
    for key in ("bytes", "crc32"):
        if not isinstance(record.get(key), int) or isinstance(record.get(key), bool) or record[key] < 0:
            raise FormatError(f"{path}: its sidecar's {key!r} is {record.get(key)!r}, expected an integer >= 0")
    return record


def read_piece(node_dir: str, iteration: int, rank: int) -> bytes:
    """A piece's bytes, checked against its sidecar: IntegrityError naming the file otherwise.
    Only regular files are read (a FIFO would hang the restart), the piece no further than the
    size its sidecar records."""
    path = piece_path(node_dir, iteration, rank)
    try:
        record = _sidecar(path)
        data = read_bounded(path, "local-tier piece", record["bytes"])
    except (FormatError, IncompleteCheckpointError) as e:
        raise IntegrityError(f"{path}: unreadable ({e})") from None
    if len(data) != record["bytes"]:
        raise IntegrityError(f"{path}: {len(data)} bytes, its sidecar says {record['bytes']}")
    if zlib.crc32(data) != record.get("crc32"):
        raise IntegrityError(f"{path}: CRC-32 {zlib.crc32(data):08x} differs from the saved "
                             f"{record.get('crc32', 0):08x}")
    return data


def mark_complete(node_dir: str, iteration: int, world: int, padded_vocab_size: Optional[int] = None) -> None:
    """The marker also records the saving model's padded vocabulary: a restart reads it before
    it builds its model (padding rows take part in the softmax; local_restore.peek)."""
    record = {"world": world}
    if padded_vocab_size is not None:
        record["padded_vocab_size"] = int(padded_vocab_size)
    atomic_write_json(os.path.join(iteration_dir(node_dir, iteration), COMPLETE), record)
    fsync_dir(node_dir)


def marked_padded_vocab(node_dir: str, iteration: int) -> Optional[int]:
    """The padded vocabulary a COMPLETE marker records; None when it records none (a tier of an
    older release) or the marker is unreadable (complete_iterations passes over those)."""
    try:
        padded = read_json(os.path.join(iteration_dir(node_dir, iteration), COMPLETE),
                           "local-tier COMPLETE marker", MAX_SIDECAR_BYTES).get("padded_vocab_size")
    except (FormatError, IncompleteCheckpointError):
        return None
    return padded if type(padded) is int and padded > 0 else None


def complete_iterations(node_dir: str) -> Dict[int, int]:
    """Iteration -> saving world size, of the iterations this node marked complete."""
    out = {}
    if not os.path.isdir(node_dir):
        return out
    for name in os.listdir(node_dir):
        it = iteration_of(name)
        marker = os.path.join(node_dir, name, COMPLETE)
        if it is None or not os.path.isfile(marker):
            continue
        try:
            world = read_json(marker, "local-tier COMPLETE marker", MAX_SIDECAR_BYTES)["world"]
        except (FormatError, IncompleteCheckpointError, KeyError):
            continue
        if isinstance(world, int) and world > 0:
            out[it] = world
    return out


def held_ranks(node_dir: str, iteration: int) -> List[int]:
    """The saving ranks whose pieces (with a sidecar) this node holds of `iteration`."""
    folder = iteration_dir(node_dir, iteration)
    out = []
    for name in os.listdir(folder):
        if name.startswith("rank_") and name.endswith(".json"):
            try:
                out.append(int(name[len("rank_"):-len(".json")]))
            except ValueError:
                continue
    return sorted(out)


def listed_size(node_dir: str, iteration: int, rank: int) -> Tuple[int, Optional[str]]:
    """(bytes, None) as a piece's sidecar records them, or (0, why) when the sidecar is bad;
    the piece itself is checked when it is read (read_piece)."""
    path = piece_path(node_dir, iteration, rank)
    try:
        return _sidecar(path)["bytes"], None
    except (FormatError, IncompleteCheckpointError) as e:
        return 0, f"{path}: sidecar unreadable ({e})"


def prune(node_dir: str, keep: int = 2) -> None:
    """Keep the newest `keep` complete iterations; remove older ones and dead partial saves."""
    complete = sorted(complete_iterations(node_dir))
    if not complete:
        return
    kept = set(complete[-keep:])
    for name in os.listdir(node_dir):
        it = iteration_of(name)
        if it is not None and it not in kept and it < max(kept):
            shutil.rmtree(os.path.join(node_dir, name), ignore_errors=True)
