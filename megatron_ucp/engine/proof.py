"""The resume proof: what a checkpoint's state computes, recorded at save, recomputed at load.

Checksums prove that the bytes are the ones written; they say nothing of what the bytes mean.
A restore that puts the right bytes in the wrong place (another padding, a rank's piece in
another rank's slot, another iteration's moments, a mapping of an import that is off) trains
on without a word. So every save records two layout-free fingerprints of the state it holds,
and every load recomputes them on the new layout before the first step:

- `losses`: the per-token losses of a fixed probe sequence (token ids drawn from a generator
  seeded with PROBE_SEED and the vocabulary, not from the data pipeline), computed in eval mode
  (no dropout) through megatron's own forward-only pipeline schedule, on every layout. The
  padded vocabulary, every head and every layer take part; compared token by token, within a
  tolerance that separates layout noise (fp32: ~1e-6; bf16: ~1e-2) from a wrong state.
- `digests`: per atomic tensor and state (the fp32 master weight, Adam's moments, the padding
  rows), the sum of its values weighted by a fixed pseudo-random pattern of global positions
  (separable over dimensions, so each rank contracts the boxes it holds in a few matvecs, and
  the sum over ranks is the same on every layout). A forward pass cannot see the moments, and
  barely sees one wrong head early in training; a digest changes with any value. Compared
  exactly (to float64 rounding) where both runs keep a state in the same dtype.

Its cost: one forward pass of one sequence, and one multiply-add pass over the state (docs/FORMAT.md
"resume proof"; the benchmark measures it against a save).
"""

import math
import threading
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ucp.errors import IntegrityError
from megatron_ucp.format.manifest import MAX_PROBE_TOKENS

PROOF_VERSION = 1
PROBE_SEED = 20240917  # fixed: the probe is the same sequence for every run of a vocabulary
# Digests of the same values summed in another order (another layout cuts the innermost
# dimension's fp32 dot products elsewhere) differ by fp32 rounding of those sums, relative to
# the sum of |terms|: far below what a wrong state moves (a swapped pair of heads: ~1e-2).
DIGEST_ROUNDING = 1e-5
# Per-token tolerance of the probe's losses (docs/design.md, "The resume proof", measured on
# the own loop's resume tests): fp32 layout noise 4.8e-7, bf16 1.8e-3; a state fault moves some
# token by 2e-3 (one pair of key rows swapped after 6 steps: the digests name it) to 0.14 (a
# tensor of another model). Another device or layer implementation (GPU/TE -> CPU/local) rounds
# each matmul otherwise: "implementation" holds it.
TOLERANCE = {"float32": 1e-3, "reduced": 2e-2, "implementation": 6e-2}
# States kept in another dtype on the two sides (bf16 moments, a bf16 model param on a load
# without optimizer): equal within that dtype's rounding.
_EPS = {"float32": 0.0, "float64": 0.0, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


# Adam's moments may be kept in bf16 behind fp32 views (megatron's precision-aware optimizer
# hands its fragments out as fp32): their digests compare within bf16's rounding. A moment of
# another iteration moves exp_avg by (1 - beta1) of itself per step: far beyond it.
_MOMENTS_EPS = 2.0 ** -7


class ResumeProofError(IntegrityError):
    """The restored state computes something else than the saved one did."""


@dataclass(frozen=True)
class Probe:
    """The probe sequence: `tokens` ids below `vocab_size`, from PROBE_SEED."""

    tokens: int
    vocab_size: int

    def ids(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(PROBE_SEED + self.vocab_size)
        return torch.randint(0, self.vocab_size, (1, self.tokens + 1), generator=g)


def probe_length(seq_length: int, multiple: int) -> int:
    """The probe's length: the run's sequence length up to MAX_PROBE_TOKENS, kept a multiple of
    what the layout needs (TP with sequence parallelism, 2 x CP), so that any layout whose
    multiple divides it can run it."""
    n = min(seq_length, MAX_PROBE_TOKENS)
    return max(multiple, n - n % multiple)


def layout_multiple() -> int:
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    return math.lcm(2 * cp if cp > 1 else 1, ps.get_tensor_model_parallel_world_size())


# -- the probe's forward pass --

def _model_seq_length(gpt) -> int:
    return int(getattr(gpt, "max_sequence_length", 0) or MAX_PROBE_TOKENS)


class _Eval:
    """Model chunks in eval mode with their parameters whole (megatron's forward pre-hooks of
    --overlap-param-gather off, after one parameter sync, as its own save does), restored after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.modes = [c.training for c in self.model]
        self.hooked = [c for c in self.model
                       if getattr(c, "use_forward_hook", False) and getattr(c, "remove_forward_pre_hook_handles", None)]
        for c in self.hooked:
            c.disable_forward_pre_hook(param_sync=True)
        for c in self.model:
            c.eval()
        return self

    def __exit__(self, *exc):
        for c, mode in zip(self.model, self.modes):
            c.train(mode)
        for c in self.hooked:
            c.enable_forward_pre_hook()


def probe_losses(model, probe: Probe) -> List[float]:
    """Collective: the per-token losses of `probe` on this layout, the same list on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ucp.engine.collective import group_device

    device = group_device()
    ids = probe.ids()
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
             "position_ids": torch.arange(probe.tokens, dtype=torch.int64)[None],
             "loss_mask": torch.ones(1, probe.tokens, dtype=torch.float32)}
    batch = _on_this_cp_rank({k: v.to(device) for k, v in batch.items()})

    def loss_func(output):
        losses = output.float().reshape(-1)
        return losses.sum() * 0.0, {"probe": losses.detach().clone()}

    def forward_step(data_iterator, chunk):
        b = next(data_iterator)
        out = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])
        return out, loss_func

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    micro = ps.get_pipeline_model_parallel_world_size() if vpp else 1  # the interleaved schedule's minimum
    iterators = [iter([batch] * micro) for _ in model]
    with _Eval(model), torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model, num_microbatches=micro, seq_length=probe.tokens, micro_batch_size=1,
            decoder_seq_length=probe.tokens, forward_only=True)
    total = torch.zeros(probe.tokens, dtype=torch.float64, device=device)
    contributes = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_data_parallel_rank() == 0)
    if contributes and stored:
        positions = batch["position_ids"].reshape(-1)
        total[positions] = stored[0]["probe"].to(device=device, dtype=torch.float64)
    dist.all_reduce(total)
    return total.cpu().tolist()


def _on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's chunks of the sequence: megatron's load-balanced split (2 x
    CP chunks, rank r holding chunks r and 2 CP - 1 - r); the position ids say which tokens they
    are. Written out here: megatron's helper changed its signature between releases."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return batch
    r = ps.get_context_parallel_rank()
    out = {}
    for key, val in batch.items():
        chunks = val.view(val.shape[0], 2 * cp, val.shape[1] // (2 * cp))
        index = torch.tensor([r, 2 * cp - 1 - r], device=val.device)
        out[key] = chunks.index_select(1, index).reshape(val.shape[0], -1)
    return out


# -- state digests --

def flat_range_boxes(shape, start: int, stop: int) -> List[Tuple[tuple, tuple]]:
    """Row-major elements [start, stop) of a box of `shape` as at most 2 x ndim - 1 sub-boxes
    (offset in the box, shape; both of the box's rank), in order: each is a contiguous run of
    the range's data."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(stop, row)

    def in_row(r, lo, hi):
        return [((r,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, row)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
    if c1:
        out += in_row(r1, 0, c1)
    return out


_PATTERNS: Dict[tuple, torch.Tensor] = {}


def pattern(name: str, part: str, dim: int, size: int, device) -> torch.Tensor:
    """The digest's weights along one dimension of an atomic tensor's part: fixed by its name,
    in [-1, 1), float64. The digest weights element (i0, i1, ...) by the product of each
    dimension's weight: separable, so that any box of the tensor contracts in a few matvecs."""
    key = (name, part, dim, size, str(device))
    if key not in _PATTERNS:
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}|{part}|{dim}".encode()))
        _PATTERNS[key] = (torch.rand(size, generator=g, dtype=torch.float64) * 2 - 1).to(device)
    return _PATTERNS[key]


_CHUNK = 1 << 24  # elements contracted at a time on an accelerator (64 MiB of fp32)
# On a CPU, 2 MiB of fp32 at a time: the second pass over a slice (|x|, the scale) then finds
# it in the cache, and |x| goes into a reused buffer (torch's L1 norm is not vectorized on a CPU:
# 5x the time of a sum). A [8192, 8192] tensor: 0.040 s against 0.075 s in fp32, 0.039 s
# against 0.317 s in bf16 (docs/design.md, "The resume proof").
_CPU_CHUNK = 1 << 19
_scratch = threading.local()  # a save's digests run in a thread of their own


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's reused CPU buffer of at least `numel` elements of `dtype`."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def box_digest(name: str, part: str, part_shape, offset, data: torch.Tensor) -> Tuple[float, float]:
    """(sum of data x weights, an upper bound of sum |data x weights|) of the box at `offset`
    holding `data`. The innermost dimension contracts in the data's own dtype (one pass over
    the state, no copy: the fp32 rounding of those sums is DIGEST_ROUNDING's), the rest in
    float64; in slices along the first dimension."""
    if data.dim() == 0:
        data = data.reshape(1)
    last = data.dim() - 1
    w_last = pattern(name, part, last, part_shape[last], data.device)[offset[last]:offset[last] + data.shape[last]]
    wide = data.dtype in (torch.float32, torch.float64)  # bf16/fp16 states: in fp32 (no overflow)
    dtype = data.dtype if wide else torch.float32
    w_inner = w_last.to(dtype)
    cpu = data.device.type == "cpu"
    total = scale = 0.0
    rows = max(1, (_CPU_CHUNK if cpu else _CHUNK) // max(1, data[0].numel()))
    for lo in range(0, data.shape[0], rows):
        chunk = data[lo:lo + rows]
        cached = cpu and chunk.numel() <= _CPU_CHUNK  # not a row larger than a slice: no such buffer kept
        if cached:  # widened into, and |x| taken in, a buffer the cache holds
            buf = _buffer(chunk.numel(), dtype).view(chunk.shape)
            if not wide:
                chunk = buf.copy_(chunk)
        elif not wide:
            chunk = chunk.float()
        w = w_inner[lo:lo + rows] if last == 0 else w_inner  # a vector's slices are of its only dimension
        x = (chunk.reshape(-1, chunk.shape[-1]) @ w).to(torch.float64).reshape(chunk.shape[:-1])
        for dim in reversed(range(last)):
            start = offset[dim] + (lo if dim == 0 else 0)
            x = x @ pattern(name, part, dim, part_shape[dim], data.device)[start:start + x.shape[dim]]
        total += float(x)
        # |w| <= 1: sum |x| bounds sum |x w|; in fp32 (8x faster than float64)
        scale += float(torch.abs(chunk, out=buf).sum() if cached else torch.linalg.vector_norm(chunk, 1))
    return total, scale


def region_digest(name: str, part_shape, region, data: torch.Tensor) -> Tuple[float, float]:
    """The digest of `region` (a box's flat range, layout.Region) whose elements are `data`
    (1-D, in the box's row-major order)."""
    total = scale = 0.0
    pos = 0
    for sub_offset, sub_shape in flat_range_boxes(region.shape, region.start, region.stop):
        n = math.prod(sub_shape)
        offset = tuple(o + s for o, s in zip(region.offset, sub_offset))
        d, a = box_digest(name, region.part, part_shape, offset, data[pos:pos + n].reshape(sub_shape))
        total, scale, pos = total + d, scale + a, pos + n
    return total, scale


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def state_digests(regions) -> Tuple[Dict[str, list], Dict[str, str]]:
    """({"name|state": [digest, scale]}, {state: dtype}) of `regions` (engine.save.owned_regions:
    this rank's share of the job's state, each region of it exactly once, with its data)."""
    out, dtypes = {}, {}
    with torch.no_grad():
        for name, region, part_shape, offset, by_state in regions:
            for state, source in by_state.items():
                dtypes[state] = _dtype_name(source)
                data = source.detach().reshape(-1)[offset:offset + region.numel]
                d, a = region_digest(name, part_shape, region, data)
                part = "|padding" if region.part else ""  # compared only on the same padding
                acc = out.setdefault(f"{name}{part}|{state}", [0.0, 0.0])
                acc[0] += d
                acc[1] += a
    return out, dtypes


def merged_digests(parts):
    """Every rank's (digests, dtypes) summed and merged: the job's."""
    values, dtypes = {}, {}
    for v, d in parts:
        for key, (digest, scale) in v.items():
            acc = values.setdefault(key, [0.0, 0.0])
            acc[0] += digest
            acc[1] += scale
        for state, name in d.items():
            dtypes[state] = _coarser(dtypes.get(state), name)
    return values, dtypes


def gathered_digests(regions):
    """Collective: every rank's digests summed and dtypes merged (the same on every rank)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state_digests(regions))
    return merged_digests(everyone)


def source_dtypes(sources) -> Dict[str, str]:
    """{state: dtype} of a rank's sources ({state: tensor} each), the coarsest where they differ:
    the dtypes the state is kept in, which the digests' comparison allows for."""
    dtypes = {}
    for by_state in sources:
        for state, t in by_state.items():
            dtypes[state] = _coarser(dtypes.get(state), _dtype_name(t))
    return dtypes


def _coarser(a: Optional[str], b: str) -> str:
    if a is None:
        return b
    return a if _EPS.get(a, 1.0) >= _EPS.get(b, 1.0) else b


# -- record and check --

def _compute_dtype(model) -> str:
    from megatron_ucp.mcore.model_map import unwrap

    c = unwrap(model[0]).config
    if getattr(c, "bf16", False):
        return "bfloat16"
    if getattr(c, "fp16", False):
        return "float16"
    return _dtype_name(torch.empty(0, dtype=c.params_dtype))


def record(model, regions, vocab_size: int) -> dict:
    """Collective: the proof of the state the model (and optimizer) holds, `regions` its data
    (engine.save.owned_regions)."""
    return with_digests(record_probe(model, vocab_size), [gathered_digests(regions)])


def record_probe(model, vocab_size: int) -> dict:
    """Collective: the proof but its digests: the probe's losses of the model as it is now. A
    save adds the digests of what it writes (with_digests), in the background for an async one."""
    from megatron_ucp.mcore.model_map import unwrap

    probe = Probe(probe_length(_model_seq_length(unwrap(model[0])), layout_multiple()), int(vocab_size))
    return {"version": PROOF_VERSION,
            "probe": {"seed": PROBE_SEED, "tokens": probe.tokens, "vocab_size": probe.vocab_size},
            **_probed(model, probe)}


def _probed(model, probe: Probe) -> dict:
    from megatron_ucp.mcore.model_map import unwrap

    losses = probe_losses(model, probe) if _runs_here(model) else None
    return {"dtype": _compute_dtype(model), "device": _device_type(model),
            "padded_vocab_size": int(unwrap(model[0]).vocab_size),
            "losses": None if losses is None else [finite(v) for v in losses]}


def with_digests(probed: dict, parts) -> dict:
    """The whole proof: `probed` (record_probe) and the job's digests, `parts` every rank's
    (digests, dtypes) (state_digests; merged_digests)."""
    digests, dtypes = merged_digests(parts)
    return {**probed, "state_dtypes": dtypes,
            "digests": {k: [finite(d), finite(a)] for k, (d, a) in sorted(digests.items())}}


def _runs_here(model) -> bool:
    """Whether this machine can run the model's forward pass: legacy grouped-GEMM experts are
    GPU kernels (megatron asserts bf16 on CUDA); their checkpoints carry digests only on CPU."""
    from megatron_ucp.mcore.model_map import unwrap

    return not (getattr(unwrap(model[0]).config, "moe_grouped_gemm", False) and _device_type(model).startswith("cpu"))


def _measure(model, regions, probe: Probe) -> dict:
    return with_digests(_probed(model, probe), [gathered_digests(regions)])


def _device_type(model) -> str:
    """Where and with which layers the probe ran: "cpu/local", "cuda/te", ..."""
    from megatron_ucp.engine.collective import group_device

    te = any(type(m).__module__.startswith("transformer_engine") for chunk in model for m in chunk.modules())
    return f"{group_device().type}/{'te' if te else 'local'}"


def finite(v: float):
    """A value as the record keeps it: JSON has no NaN or infinity (None stands for them)."""
    return float(v) if math.isfinite(v) else None


def source_record(probe: Probe, device: str, padded_vocab_size: int, losses, digests: dict) -> dict:
    """The proof of a source computed outside megatron (an import's reference forward and the
    fp32 `param` digests of the weights it writes), in the record's format."""
    return {"version": PROOF_VERSION,
            "probe": {"seed": PROBE_SEED, "tokens": probe.tokens, "vocab_size": probe.vocab_size},
            "dtype": "float32", "device": device, "padded_vocab_size": padded_vocab_size,
            "losses": [finite(v) for v in losses], "state_dtypes": {"param": "float32"},
            "digests": dict(sorted(digests.items()))}


def loss_tolerance(saved: dict, now: dict) -> float:
    """fp32 on both sides of the same kind of device (another layer implementation on the CPU,
    e.g. Hugging Face's against the local spec: 9.5e-7 measured) keeps fp32's; another device
    (GPU/TE -> CPU) the implementation tolerance; reduced precision its own."""
    same_device = str(saved.get("device", "")).split("/")[0] == now["device"].split("/")[0]
    if saved.get("dtype") == now["dtype"] == "float32" and same_device:
        return TOLERANCE["float32"]
    if saved.get("device") != now["device"]:
        return TOLERANCE["implementation"]
    return TOLERANCE["reduced"]


def largest_delta(saved: dict, now: dict) -> Tuple[float, int]:
    """(max |delta|, its token) of the probe's per-token losses (inf where one side is not
    finite; 0 where either side could not run the probe)."""
    worst = (0.0, 0)
    if saved.get("losses") is None or now.get("losses") is None:
        return worst
    for i, (a, b) in enumerate(zip(saved["losses"], now["losses"])):
        d = math.inf if (a is None) != (b is None) else (0.0 if a is None else abs(a - b))
        worst = max(worst, (d, i))
    return worst


def same_padding(saved: dict, now: dict) -> bool:
    """Both runs pad the vocabulary alike: only then do the probe's losses (the padding rows
    take part in the softmax) and the padding rows' digests compare. Where a load pads
    otherwise (a TP size that does not divide the saved padding), the trainer says so."""
    return saved.get("padded_vocab_size") == now["padded_vocab_size"]


def compare(saved: dict, now: dict) -> Optional[str]:
    """Why `now` (record() on the new layout) is not the state `saved` recorded, or None. The
    digests first: they name the tensor."""
    for key, (a, scale_a) in saved.get("digests", {}).items():
        if key not in now["digests"] or ("|padding|" in key and not same_padding(saved, now)):
            continue  # a state this load does not restore (--no-load-optim, a weights-only load)
        b, scale_b = now["digests"][key]
        state = key.rsplit("|", 1)[1]
        eps = max(_EPS.get(saved["state_dtypes"].get(state), 1.0), _EPS.get(now["state_dtypes"].get(state), 1.0),
                  _MOMENTS_EPS if state != "param" else 0.0)
        tol = (eps + DIGEST_ROUNDING) * max(scale_a or 0.0, scale_b or 0.0)
        if None in (a, b, scale_a, scale_b) or abs(a - b) > tol:
            return (f"tensor {key.rsplit('|', 1)[0]!r} {state}: digest {a!r} saved, {b!r} now "
                    f"(tolerance {tol:.3g}): its values differ")
    tol = loss_tolerance(saved, now)
    d, i = largest_delta(saved, now) if same_padding(saved, now) else (0.0, 0)
    if d > tol:
        return (f"probe token {i}: loss {saved['losses'][i]!r} saved, {now['losses'][i]!r} now "
                f"(|delta| {d:.3g} > tolerance {tol:g}, {saved.get('dtype')} -> {now['dtype']}): the model "
                "computes something else")
    return None


def check(saved: Optional[dict], model, regions, vocab_size: int, where: str,
          tier: str = "persistent") -> Optional[str]:
    """Collective: recompute the proof on this layout and raise ResumeProofError (the same on
    every rank) when it differs from `saved`; returns the line that says how it went."""
    from megatron_ucp.mcore.model_map import unwrap

    if saved is None:
        return f"{where} holds no resume proof (saved before megatron-ucp recorded one): loaded unchecked"
    problem = _unusable(saved, unwrap(model[0]), vocab_size)
    if problem:
        return f"{where}: resume proof not checked: {problem}"
    probe = Probe(int(saved["probe"]["tokens"]), int(saved["probe"]["vocab_size"]))
    now = _measure(model, regions, probe)
    why = compare(saved, now)
    if why is not None:
        raise ResumeProofError(f"{where}: the restored state fails its resume proof ({tier} tier): {why}; "
                               "the checkpoint's bytes do not mean the state that was saved "
                               "(--no-resume-proof loads it anyway)")
    digests = f"{len(now['digests'])} state digests equal"
    if not same_padding(saved, now):
        return (f"resume proof: {digests}; the probe's losses not compared: the vocabulary is padded to "
                f"{now['padded_vocab_size']} rows here, to {saved.get('padded_vocab_size')} when saved")
    if saved.get("losses") is None or now["losses"] is None:
        return (f"resume proof: {digests}; the probe's losses not compared: the model's forward pass "
                "runs on GPUs only (grouped-GEMM experts)")
    d, _ = largest_delta(saved, now)
    return (f"resume proof passed: {probe.tokens} probe tokens within {d:.2g} of the saved losses "
            f"(tolerance {loss_tolerance(saved, now):g}), {digests}")


def _unusable(saved: dict, gpt, vocab_size: int) -> Optional[str]:
    """Why this layout cannot run the saved probe (then the proof is skipped, with a line)."""
    probe = saved["probe"]
    if probe["vocab_size"] != vocab_size:
        return f"probe of vocabulary {probe['vocab_size']}, model of {vocab_size}"
    if probe["tokens"] % layout_multiple():
        return (f"the probe's {probe['tokens']} tokens do not split over this layout "
                f"(a multiple of {layout_multiple()} needed)")
    if gpt.position_embedding_type == "learned_absolute" and probe["tokens"] > _model_seq_length(gpt):
        return f"the probe's {probe['tokens']} tokens exceed the model's {_model_seq_length(gpt)} positions"
    return None
