"""Hugging Face model folders <-> universal checkpoints, one tensor at a time.

The names, shapes and reorderings are hf_map.py's; this module only reads and writes files.
Export reads each atomic tensor's `param` (checksums verified) and writes it, split into its HF
tensors, into sharded safetensors files whose headers are planned up front, so memory holds one
atomic tensor. Import reads the HF tensors of one atomic tensor, joins them in fp32 and writes a
weights-only universal checkpoint at iteration 0 through writer.py.
"""

import contextlib
import json
import math
import os
import shutil
import struct
import time
import uuid

import numpy as np

from megatron_ucp.convert import hf_config, hf_map, output_folder
from megatron_ucp.convert.source_model import given_args
from megatron_ucp.engine.ownership import process_start
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError
from megatron_ucp.format import durability, manifest as mf, safe_files, storage, tensor_io
from megatron_ucp.format.tensor_entry import TensorEntry, file_layout
from megatron_ucp.mcore import saved_args
from megatron_ucp.mcore.flags import build_parser

HF_DTYPES = {"fp32": ("F32", 4, "float32"), "bf16": ("BF16", 2, "bfloat16")}
MAX_CONFIG_BYTES = 2**20
MAX_INDEX_BYTES = 64 * 2**20


# ---- export ------------------------------------------------------------------------------------

def shard_plan(ps, itemsize: int, max_bytes: int) -> list:
    """Pairs cut into shards of at most `max_bytes` (a pair's HF tensors stay together)."""
    shards, current, size = [], [], 0
    for p in ps:
        nbytes = math.prod(p.shape) * itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def safetensors_header(entries, dtype: str, itemsize: int) -> bytes:
    """A safetensors header for (name, shape) entries back to back, 8-byte aligned, with the
    `format: pt` metadata transformers checks for."""
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        n = math.prod(shape) * itemsize
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def _to_bytes(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "bf16":  # round to nearest even, as torch does
        import torch

        return torch.from_numpy(np.ascontiguousarray(array)).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return np.ascontiguousarray(array, dtype="<f4").tobytes()


def read_param(root: str, name: str, entry: TensorEntry, verify: bool = True, source=None) -> np.ndarray:
    """An atomic tensor's fp32 `param` (without vocabulary padding), its checksums verified.
    `source`: an engine/store_source.StoreSource for a checkpoint in an object store (ranged
    GETs of the object's blocks to verify, then of the param's bytes; nothing on local disk)."""
    from megatron_ucp.errors import IntegrityError
    from megatron_ucp.format import inspection

    if source is not None:
        from megatron_ucp.format import store_inspection

        problems = (store_inspection.verify_object if verify else store_inspection.check_object)(
            source.store, root, name, entry)
        if problems:
            raise IntegrityError("; ".join(problems))
        out = np.empty(entry.shape, np.float32)
        source.read_runs(name, file_layout(entry), "param", [(0, 0, out.size)], out)
        return out
    if verify:
        problems = inspection.verify_tensor(root, name, entry)
        if problems:
            raise IntegrityError("; ".join(problems))
    else:
        inspection.check_header(root, name, entry)
    layout = file_layout(entry)
    out = np.empty(entry.shape, np.float32)
    tensor_io.read_runs(safe_files.safe_join(root, entry.file), layout, "param", [(0, 0, out.size)], out)
    return out


def _fresh_output(output: str) -> str:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConfigError(f"{output} exists and is not an empty folder; choose another output")
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    prefix = f".tmp_{os.path.basename(os.path.abspath(output))}_"
    _remove_dead_exports(parent, prefix)
    tmp = os.path.join(parent, f"{prefix}{os.getpid()}_{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    return tmp


def _remove_dead_exports(parent: str, prefix: str) -> None:
    """The temporary folders of earlier exports to the same output whose process is gone (a
    killed export left them in the parent folder for ever)."""
    for name in os.listdir(parent):
        pid = name[len(prefix):].split("_")[0] if name.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and process_start(int(pid)) is None:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# The manifest's arguments the HF config takes its numbers from (hf_map.from_checkpoint).
HF_ARGS = ("rotary_base", "norm_epsilon", "max_position_embeddings", "seq_length", "moe_router_topk")


def export(checkpoint: str, output: str, iteration=None, dtype: str = "fp32", max_shard_bytes: int = 5 * 10**9,
           progress: bool = True, verify: bool = True, staging_dir=None) -> dict:
    """Write the HF model folder of a universal checkpoint (into an empty object-store prefix:
    through a local staging folder under `staging_dir`); returns a summary."""
    from tqdm import tqdm

    from megatron_ucp.format import inspection
    from megatron_ucp.format.folder import iteration_dir

    if dtype not in HF_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {sorted(HF_DTYPES)}")
    if not (isinstance(max_shard_bytes, (int, float)) and math.isfinite(max_shard_bytes) and max_shard_bytes >= 1):
        raise ConfigError(f"--max-shard-gb: expected a finite size > 0, got {max_shard_bytes / 1e9!r} GB")
    max_shard_bytes = int(max_shard_bytes)
    if storage.is_remote(output):  # written in a staging folder, then uploaded (store_staging.py)
        from megatron_ucp.convert import store_staging

        store_staging.check_empty(output)
        tmp = store_staging.staging_root(staging_dir)
        try:
            local = os.path.join(tmp, "hf")
            summary = export(checkpoint, local, iteration, dtype, max_shard_bytes, progress, verify)
            store_staging.upload_folder(local, output, last=("model.safetensors.index.json", "config.json"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dict(summary, output=output)
    output_folder.refuse_inside_checkpoint(output, "output")
    start = time.perf_counter()
    root = iteration_dir(checkpoint, iteration) if iteration is not None else inspection.resolve(checkpoint)
    m = mf.read_manifest(root)
    source = None
    if storage.is_remote(root):  # s3://, msc://: read through the store
        from megatron_ucp.engine.store_source import StoreSource

        source = StoreSource(root)
    args = m.args if isinstance(m.args, dict) else {}
    saved_args.typed(args, HF_ARGS, build_parser(), os.path.join(root, mf.MANIFEST))
    model = hf_map.from_checkpoint(m.architecture, args, m.tensors)
    hf_map.check_names(model, m.tensors, root)
    ps = hf_map.pairs(model)
    for p in ps:
        if m.tensors[p.megatron].shape != tuple(p.shape):
            raise FormatError(f"{root}: tensor {p.megatron!r} has shape {list(m.tensors[p.megatron].shape)}, "
                              f"the architecture needs {list(p.shape)}")
    st_dtype, itemsize, torch_dtype = HF_DTYPES[dtype]
    shards = shard_plan(ps, itemsize, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    tmp = _fresh_output(output)
    total = sum(math.prod(p.shape) * itemsize for p in ps)
    weight_map = {}
    try:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="exporting", disable=not progress)
        for fname, shard in zip(names, shards):
            entries = [(n, s) for p in shard for n, s in zip(p.hf, p.hf_shapes)]
            with open(os.path.join(tmp, fname), "wb") as f:
                f.write(safetensors_header(entries, st_dtype, itemsize))
                for p in shard:
                    tensor = read_param(root, p.megatron, m.tensors[p.megatron], verify, source)
                    for piece in p.split(tensor):
                        f.write(_to_bytes(piece, dtype))
                    del tensor
                    bar.update(math.prod(p.shape) * itemsize)
                f.flush()
                os.fsync(f.fileno())
            weight_map.update({n: fname for n, _ in entries})
        bar.close()
        config = hf_map.hf_config(model, torch_dtype)
        durability.atomic_write_json(os.path.join(tmp, "config.json"), config)
        durability.atomic_write_json(os.path.join(tmp, "generation_config.json"),
                                  {"_from_model_config": True, "do_sample": False})
        if len(shards) > 1:
            durability.atomic_write_json(os.path.join(tmp, "model.safetensors.index.json"),
                                      {"metadata": {"total_size": total}, "weight_map": weight_map})
        if os.path.isdir(output):
            os.rmdir(output)  # empty, checked above
        os.rename(tmp, output)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = output_folder.disk_full(e, output)
        if full is not None:
            raise full from e
        raise
    seconds = time.perf_counter() - start
    return {"family": hf_map.ARCHITECTURES[model.family], "iteration": m.iteration, "output": output,
            "tensors": len(weight_map), "files": len(shards), "bytes": total, "seconds": seconds,
            "GB/s": total / seconds / 1e9}


# ---- import ------------------------------------------------------------------------------------

def _check_regular(path: str, folder: str) -> None:
    """A model folder is input from strangers: each file it names must be a regular file in it."""
    try:
        os.close(safe_files.open_regular(path, "HF safetensors file", folder))
    except FormatError as e:
        raise FormatError(f"{e}{_cache_hint(folder)}") from None


def _cache_hint(folder: str) -> str:
    """For a Hugging Face cache snapshot (files that are symlinks into ../../blobs): how to get a
    folder of its own, which is what is read (a link out of the folder is never followed)."""
    try:
        links = [n for n in os.listdir(folder) if os.path.islink(os.path.join(folder, n))]
    except OSError:
        return ""
    if not links:
        return ""
    return (f" ({folder} holds symlinks, like a Hugging Face cache snapshot linking into ../../blobs: copy it "
            "with `cp -rL`, or download with `local_dir=`, and import the copy)")


class HFReader:
    """The tensors of a HF model folder (one safetensors file or an index of shards), by name."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.lexists(index):
            weight_map = safe_files.read_json(index, "HF index", MAX_INDEX_BYTES, folder).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise FormatError(f"{index}: 'weight_map' is not an object of file names")
            self.files = {k: safe_files.safe_join(folder, v, index) for k, v in weight_map.items()}
        elif os.path.lexists(single):
            _check_regular(single, folder)
            with _safe_open(single) as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise IncompleteCheckpointError(f"{folder}: neither model.safetensors nor model.safetensors.index.json "
                                            "(only safetensors folders are read)")
        for path in set(self.files.values()):  # safe_open would block on a FIFO, read /dev/zero...
            _check_regular(path, folder)
        self._shapes, self._dtypes = {}, {}

    def shape(self, name: str) -> tuple:
        if name not in self._shapes:
            path = self.files[name]
            with _safe_open(path) as f:
                for k in f.keys():
                    if self.files.get(k) == path:
                        piece = f.get_slice(k)
                        self._shapes[k], self._dtypes[k] = tuple(piece.get_shape()), piece.get_dtype()
            if name not in self._shapes:
                raise IncompleteCheckpointError(f"{path}: tensor {name!r} named by the index is missing")
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        """The safetensors dtype its header gives ('F32', 'BF16', 'I32', ...)."""
        self.shape(name)
        return self._dtypes[name]

    def read(self, name: str) -> np.ndarray:
        """The tensor in fp32."""
        with _safe_open(self.files[name]) as f:
            try:
                return f.get_tensor(name).float().numpy()
            except Exception as e:  # safetensors' own error type is not importable alike in every release
                raise FormatError(f"{self.files[name]}: tensor {name!r} cannot be read: {e}") from None


@contextlib.contextmanager
def _safe_open(path: str):
    """safetensors' reader, its refusal (a lying header, a pickle renamed .safetensors) one line
    naming the file."""
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt")
    except Exception as e:  # SafetensorError, or an OSError of the file
        raise FormatError(f"{path}: not a readable safetensors file: {e}") from None
    with f:
        yield f


def check_hf_tensors(model: hf_map.Model, reader: HFReader) -> None:
    """Every tensor the config implies is there with its shape, and nothing else (a tied lm_head
    copy and rotary buffers aside): errors name the tensor."""
    want = hf_map.hf_index(model)
    missing = sorted(set(want) - set(reader.files))
    if missing:
        raise IncompleteCheckpointError(f"{reader.folder}: tensor {missing[0]!r} missing"
                                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    ignored = {"lm_head.weight"} if model.tied else set()
    if model.tied and "lm_head.weight" in reader.files and not np.array_equal(
            reader.read("lm_head.weight"), reader.read("model.embed_tokens.weight")):
        raise FormatError(f"{reader.files['lm_head.weight']}: 'lm_head.weight' differs from "
                          "'model.embed_tokens.weight' but config.json says tie_word_embeddings true; "
                          "expected a tied copy (or tie_word_embeddings false)")
    extra = sorted(n for n in set(reader.files) - set(want) - ignored if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise FormatError(f"{reader.folder}: tensor {extra[0]!r} has no place in a "
                          f"{hf_map.ARCHITECTURES[model.family]} of this config.json")
    for name, shape in want.items():
        if reader.shape(name) != tuple(shape):
            raise FormatError(f"{reader.folder}: tensor {name!r} has shape {list(reader.shape(name))}, "
                              f"config.json implies {list(shape)}")
        if reader.dtype(name) not in hf_config.FLOAT_DTYPES:
            raise FormatError(f"{reader.files[name]}: tensor {name!r} has dtype {reader.dtype(name)}, expected "
                              f"a floating-point one ({', '.join(hf_config.FLOAT_DTYPES)})")


_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")  # not read here


def _hf_reads(rel: str) -> bool:
    """The objects of an HF folder in a store that the import reads: its own files (config,
    safetensors, index, tokenizer), not subfolders or other frameworks' weights."""
    return "/" not in rel and not rel.endswith(_OTHER_WEIGHTS)


def import_(hf_dir: str, output: str, progress: bool = True, workers: int = 1, prove: bool = True,
            staging_dir=None, origin=None) -> dict:
    """Write the weights of a HF model folder as a universal checkpoint at iteration 0, with the
    resume proof of what transformers computes from the folder (hf_proof.py; `prove`). An
    object-store `output` is written in a local staging folder, then uploaded (store_output.py);
    an `hf_dir` in a store is downloaded into one first (store_staging.py; `origin`: its URL,
    which the manifest records)."""
    from megatron_ucp.convert import store_output, store_staging, writer as stream_write

    if storage.is_remote(hf_dir):
        with store_staging.local_input(hf_dir, staging_dir, _hf_reads) as local:
            return import_(local, output, progress, workers, prove, staging_dir, origin=hf_dir)
    if storage.is_remote(output):
        return store_output.write_to(output, lambda local: import_(hf_dir, local, progress, workers, prove,
                                                                   origin=origin),
                                     "output", staging_dir)

    start = time.perf_counter()
    path = os.path.join(hf_dir, "config.json")
    try:
        config = safe_files.read_json(path, "HF config", MAX_CONFIG_BYTES, hf_dir)
    except FormatError as e:
        raise FormatError(f"{e}{_cache_hint(hf_dir)}") from None
    hf_config.check(config, path, moe=False)
    archs = config["architectures"]
    moe = len(archs) == 1 and hf_map.FAMILY_OF.get(archs[0]) == "mixtral"
    hf_config.check(config, path, moe)
    model = hf_map.from_hf_config(config)
    reader = HFReader(hf_dir)
    embedding = "model.embed_tokens.weight"
    hf_config.against_tensors(config, reader.files, reader.shape(embedding) if embedding in reader.files else None,
                              path, hf_dir)
    check_hf_tensors(model, reader)
    ps = {p.megatron: p for p in hf_map.pairs(model)}
    metas = {n: TensorEntry.new(n, p.shape, n in hf_map.VOCAB, 0, ["param"]) for n, p in ps.items()}

    def opener(name):
        def assemble(state):
            p = ps[name]
            return {"": np.ascontiguousarray(p.join(*[reader.read(h) for h in p.hf]), np.float32)}
        return assemble

    record, proof_line = _proof(hf_dir, model, reader) if prove else (None, "resume proof not recorded (--no-proof)")
    argv = hf_map.megatron_args(model)
    layout = mf.Layout(world_size=None, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       virtual_pipeline_model_parallel_size=None, data_parallel_size=None,
                       expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                       use_distributed_optimizer=False, padded_vocab_size=model.vocab_size)
    head = mf.head(iteration=0, consumed_samples=0, architecture=hf_map.architecture(model), layout=layout,
                   optimizer=None, scheduler=None, args=given_args(argv), rng_saved=False, proof=record,
                   source={"huggingface": origin or os.path.abspath(hf_dir), "architecture": hf_map.ARCHITECTURES[model.family]})
    summary = stream_write.write_checkpoint(output, 0, metas, opener, head, {}, workers, progress, start)
    summary["family"] = hf_map.ARCHITECTURES[model.family]
    summary["megatron_args"] = argv
    summary["proof"] = proof_line
    return summary


def _proof(hf_dir: str, model: hf_map.Model, reader: HFReader):
    """(the proof record or None, the line that says so): transformers' losses of the probe,
    the digests of the weights written."""
    from megatron_ucp.convert import hf_proof

    why = hf_proof.unavailable(model)
    if why:
        return None, f"resume proof not recorded ({why})"
    try:
        record = hf_proof.record(hf_dir, model, reader.read)
    except ConfigError as e:
        return None, f"resume proof not recorded ({e})"
    return record, (f"resume proof recorded from transformers' run of the source: {record['probe']['tokens']} "
                    f"probe tokens, {len(record['digests'])} weight digests")
