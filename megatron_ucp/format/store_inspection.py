"""`inspect --verify` of a universal checkpoint in an object store (inspection.py's checks,
through the store): every tensor object's size, header and block checksums, objects the
manifest does not list, and the RNG states. Also the one check of an object's size and header
every load from a store makes (engine/store_source.py)."""

from megatron_ucp.errors import FormatError, IntegrityError, UCPError
from megatron_ucp.format import checksums, manifest as mf, safe_files, storage, stores
from megatron_ucp.format.folder import rng_file
from megatron_ucp.format.inspection import checksum_problem, resolve
from megatron_ucp.format.tensor_entry import file_layout

READ_BYTES = 64 * 2**20  # a verify's ranged GETs: whole blocks, at most this many bytes each


def check_object(store, root: str, name: str, entry) -> list:
    """inspection.check_file's problems for a tensor object: its size and header in one request."""
    try:
        path, want = storage.join(root, entry.file), file_layout(entry)
    except (FormatError, IntegrityError) as e:
        return [f"{entry.file}: {e}"]
    found = store.head(path, len(want.header))
    if found is None:
        return [f"{path}: tensor file of {name!r} is missing"]
    header, size = found
    if entry.file_size != want.file_size:
        return [f"{path}: manifest file_size {entry.file_size!r} but the layout of {name!r} needs "
                f"{want.file_size} bytes"]
    if size != entry.file_size:
        kind = "truncated" if size < entry.file_size else "too long"
        return [f"{path}: object has {size} bytes, manifest says {entry.file_size} ({kind})"]
    if header != want.header:
        return [f"{path}: header does not match the manifest's layout of {name!r}"]
    problem = checksum_problem(path, name, entry)
    return [problem] if problem else []


def verify_object(store, root: str, name: str, entry) -> list:
    """inspection.verify_tensor for a tensor object: check_object's problems, then every block
    checksum (ranged GETs of whole blocks)."""
    problems = check_object(store, root, name, entry)
    if problems:
        return problems
    return _blocks(store, storage.join(root, entry.file), len(file_layout(entry).header), entry.file_size,
                   entry.checksums, entry.block_bytes)


def _blocks(store, path: str, base: int, end: int, sums, block: int) -> list:
    """The first mismatching block's message, from ranged GETs of whole blocks."""
    per_get = max(1, READ_BYTES // block) * block
    for lo in range(base, end, per_get):
        data = store.read_ranges(path, [(lo, min(lo + per_get, end))])[0]
        for at in range(0, len(data), block):
            b = (lo - base + at) // block
            found, expected = f"{checksums.crc32(data[at:at + block]):08x}", str(sums[b]).lower()
            if found != expected:
                return [f"{path}: block {b} (bytes {lo + at}..{lo + at + len(data[at:at + block])}) has "
                        f"crc32 {found}, expected {expected}"]
    return []


def verify(path: str) -> list:
    """inspection.verify for a checkpoint in a store: problems naming object and block."""
    directory = resolve(path)
    store = stores.store_for(directory)
    m = mf.read_manifest(directory)
    problems = []
    for name in sorted(m.tensors):
        e = m.tensors[name]
        found = check_object(store, directory, name, e)
        if not found:
            try:
                found = _blocks(store, storage.join(directory, e.file), len(file_layout(e).header),
                                e.file_size, e.checksums, e.block_bytes)
            except UCPError as err:
                found = [str(err)]
        problems += found
    listed = {storage.join(directory, e.file) for e in m.tensors.values()}
    for obj, _ in store.list(storage.join(directory, "tensors")):
        if obj not in listed:
            problems.append(f"{obj}: not listed in the manifest")
    if m.rng_saved is False:
        return problems
    world = m.layout.get("world_size")
    for rank in range(world if isinstance(world, int) else 0):
        p = rng_file(storage.join(directory, "rng"), rank)
        try:
            state = safe_files.parse_json(store.read(p, safe_files.MAX_RNG_BYTES, "RNG state"), p, "RNG state")
        except UCPError as err:
            problems.append(f"{err} (rank {rank} of world_size {world})")
            continue
        problems += [mf.rng_problem_message(p, q) for q in mf.rng_problems(state)]
    return problems
