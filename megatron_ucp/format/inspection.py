"""Look inside a universal checkpoint without a model: summarize it and verify every byte.

Needs only numpy (no torch, no megatron): `describe` summarizes the manifest, `format_table`
renders that as text, `verify` re-checks every tensor file against the manifest's layout, sizes
and block checksums and returns the problems found (an empty list means the checkpoint is sound).
"""

import math
import os

from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError, UCPError
from megatron_ucp.format import checksums, manifest as mf, safe_files, storage, stores, tensor_file
from megatron_ucp.format.folder import (TRACKER, found_format, iteration_dir, read_tracker, rng_file,
                                        tracker_iteration)
from megatron_ucp.format.tensor_entry import TensorEntry, file_layout


def resolve(path: str) -> str:
    """The checkpoint folder `path` designates: an iter_ folder itself, or a save root's latest."""
    path = os.fspath(path)
    if storage.is_remote(path):  # an object store: universal checkpoints only
        return path if stores.exists(os.path.join(path, mf.MANIFEST)) else iteration_dir(path, read_tracker(path))
    if os.path.lexists(os.path.join(path, mf.MANIFEST)):  # what it is, read_manifest judges
        return path
    _refuse_other_format(path)
    tracker = os.path.join(path, TRACKER)
    if not os.path.lexists(tracker):
        raise IncompleteCheckpointError(
            f"{path}: neither a universal checkpoint ({mf.MANIFEST} missing) nor a save folder ({TRACKER} missing)")
    raw = safe_files.read_bounded(tracker, "tracker file", safe_files.MAX_TRACKER_BYTES, path)
    directory = iteration_dir(path, tracker_iteration(raw, tracker))
    _refuse_other_format(directory)
    return directory


def _refuse_other_format(directory: str) -> None:
    """A torch_dist or legacy checkpoint is named as such (not as a missing ucp.json)."""
    found, evidence = found_format(directory) if os.path.isdir(directory) else (None, None)
    if found not in (None, "universal"):
        raise FormatError(f"{directory}: holds a {found} checkpoint ({evidence}), not a universal one "
                          f"({mf.MANIFEST}); convert it with tools/convert_to_universal.py first")


def _file_bytes(entry: TensorEntry) -> int:
    size = entry.file_size
    return size if isinstance(size, int) else file_layout(entry).file_size


def describe(path: str) -> dict:
    """Manifest summary plus one row per atomic tensor; JSON-serializable."""
    directory = resolve(path)
    m = mf.read_manifest(directory)
    rows = []
    for name in sorted(m.tensors):
        e = m.tensors[name]
        rows.append({"name": name, "shape": list(e.shape), "vocab": e.vocab, "padding_rows": e.padding_rows,
                     "states": list(e.states), "bytes": _file_bytes(e)})
    return {
        "path": directory, "format": mf.FORMAT_NAME, "version": m.version,
        "iteration": m.iteration, "consumed_samples": m.consumed_samples,
        "architecture": m.architecture, "layout": m.layout,
        "optimizer_step": (m.optimizer or {}).get("step"),
        "proof": _proof_summary(m.proof),
        "num_tensors": len(rows), "total_bytes": sum(r["bytes"] for r in rows), "tensors": rows,
    }


def _proof_summary(record):
    """The resume proof in a few words (engine/proof.py), or None where none was recorded."""
    if record is None:
        return None
    losses = [v for v in record["losses"] or [] if v is not None]
    states = sorted({k.rsplit("|", 1)[1] for k in record["digests"]})
    return {"probe_tokens": record["probe"]["tokens"], "vocab_size": record["probe"]["vocab_size"],
            "dtype": record["dtype"], "device": record["device"],
            "padded_vocab_size": record["padded_vocab_size"],
            "mean_loss": sum(losses) / len(losses) if losses else None,
            "digests": len(record["digests"]), "states": states}


def _proof_line(p) -> str:
    if p is None:
        return "none recorded (saved before megatron-ucp recorded one): loads unchecked"
    mean = f"{p['mean_loss']:.4f}" if p["mean_loss"] is not None else "-"
    return (f"{p['probe_tokens']} probe tokens of vocab {p['vocab_size']} (padded {p['padded_vocab_size']}), "
            f"mean loss {mean}, {p['dtype']} on {p['device']}; {p['digests']} digests of {','.join(p['states'])}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _pairs(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items()) if d else "-"


def format_table(desc: dict) -> str:
    head = [
        f"checkpoint   {desc['path']}",
        f"format       {desc['format']} v{desc['version']}",
        f"iteration    {desc['iteration']}  consumed_samples {desc['consumed_samples']}  "
        f"optimizer_step {desc['optimizer_step'] if desc['optimizer_step'] is not None else '-'}",
        f"architecture {_pairs(desc['architecture'])}",
        f"layout       {_pairs(desc['layout'])}",
        f"proof        {_proof_line(desc['proof'])}",
        f"tensors      {desc['num_tensors']} files, {desc['total_bytes']} bytes ({_human(desc['total_bytes'])})",
        "",
    ]
    cols = ["name", "shape", "rows", "padding", "states", "bytes"]
    body = [[r["name"], "x".join(map(str, r["shape"])) or "scalar", "vocab" if r["vocab"] else "-",
             str(r["padding_rows"]), ",".join(r["states"]), str(r["bytes"])] for r in desc["tensors"]]
    widths = [max(len(x) for x in col) for col in zip(cols, *body)]
    right = {3, 5}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in [cols, ["-" * w for w in widths]] + body]
    return "\n".join(head + lines)


def _verify_blocks(path, base: int, end: int, sums: list, block: int) -> list:
    """The first mismatching block's message: the pass stops there (a file is damaged either
    way, and a lying entry may name a terabyte of blocks)."""
    try:
        checksums.verify_range(path, base, end, sums, block, base=base, end=end)
        return []
    except UCPError as e:
        return [str(e)]


def check_header(root: str, name: str, entry: TensorEntry) -> None:
    """Refuse a tensor file whose presence, kind, size or header differs from the manifest's
    layout: what every load checks, verified or not (its offsets come from that layout, so a
    valid file with another header would be misread). Raises the UCPError naming the file."""
    rel = entry.file
    try:
        path = safe_files.safe_join(root, rel)
        want = file_layout(entry)
    except UCPError as e:
        raise type(e)(f"{rel}: {e}") from None
    if not os.path.lexists(path):
        raise IncompleteCheckpointError(f"{path}: tensor file of {name!r} is missing")
    size = entry.file_size
    if size != want.file_size:
        raise FormatError(f"{path}: manifest file_size {size!r} but the layout of {name!r} needs {want.file_size} bytes")
    fd = safe_files.open_regular(path, f"tensor file of {name!r}")
    actual = os.fstat(fd).st_size
    os.close(fd)
    if actual != size:
        kind = "truncated" if actual < size else "too long"
        raise IntegrityError(f"{path}: file has {actual} bytes, manifest says {size} ({kind})")
    got = tensor_file.read_header(path)
    if got.entries != want.entries or got.header != want.header:
        raise FormatError(f"{path}: header {list(got.entries)} does not match the manifest's layout {list(want.entries)}")


def check_file(root: str, name: str, entry: TensorEntry) -> list:
    """Problems with a tensor file's presence, size and header, and with the checksums the
    manifest records for it; its blocks are not read."""
    try:
        check_header(root, name, entry)
    except UCPError as e:
        return [str(e)]
    problem = checksum_problem(safe_files.safe_join(root, entry.file), name, entry)
    return [problem] if problem else []


def checksum_problem(path: str, name: str, entry: TensorEntry):
    """What is wrong with the checksums the manifest records for a tensor file; None: nothing."""
    size, block, sums = entry.file_size, entry.block_bytes, entry.checksums
    base = len(file_layout(entry).header)
    if not (isinstance(block, int) and block > 0 and isinstance(sums, tuple)
            and len(sums) == math.ceil((size - base) / block) and all(isinstance(s, str) for s in sums)):
        return (f"{path}: manifest records bad checksums for {name!r} "
                f"(block_bytes {block!r}, {len(sums) if isinstance(sums, tuple) else sums!r} sums)")
    return None


def verify_tensor(root: str, name: str, entry: TensorEntry) -> list:
    """Problems with a tensor file: check_file's, then every block checksum."""
    problems = check_file(root, name, entry)
    if problems:
        return problems
    base = len(file_layout(entry).header)
    return _verify_blocks(safe_files.safe_join(root, entry.file), base, entry.file_size,
                          entry.checksums, entry.block_bytes)


def _verify_rng(directory: str, layout: dict) -> list:
    folder = os.path.join(directory, "rng")
    if not os.path.isdir(folder):
        return [f"{folder}: RNG folder is missing"]
    problems = []
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".json"):
            path = os.path.join(folder, fname)
            try:
                state = safe_files.read_json(path, "RNG state")
            except UCPError as e:
                problems.append(str(e))
                continue
            problems += [mf.rng_problem_message(path, p) for p in mf.rng_problems(state)]
    world = layout.get("world_size")
    for rank in range(world if isinstance(world, int) else 0):
        p = rng_file(folder, rank)
        if not os.path.exists(p):
            problems.append(f"{p}: RNG state of rank {rank} (of world_size {world}) is missing")
    return problems


def verify(path: str) -> list:
    """Check every tensor file (presence, header, size, block checksums), unlisted files and RNG
    states. Returns problem messages naming file and block; empty means OK. An unreadable
    manifest raises UCPError."""
    directory = resolve(path)
    m = mf.read_manifest(directory)
    problems = []
    for name in sorted(m.tensors):
        problems += verify_tensor(directory, name, m.tensors[name])
    listed = {e.file for e in m.tensors.values()}
    tdir = os.path.join(directory, "tensors")
    for fname in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
        if f"tensors/{fname}" not in listed:
            problems.append(f"{os.path.join(tdir, fname)}: not listed in the manifest")
    if m.rng_saved is False:  # --no-save-rng: no RNG files to check
        return problems
    return problems + _verify_rng(directory, m.layout)
