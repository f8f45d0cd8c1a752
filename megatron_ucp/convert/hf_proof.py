"""The resume proof of an imported Hugging Face model, computed from the SOURCE: transformers'
own forward pass of the HF folder on CPU in fp32 (engine/proof.py, docs/FORMAT.md 4.9).

An import writes the megatron model its mapping (hf_map.py) believes the HF model is. Its
checkpoint's padded vocabulary is the HF vocabulary (no padding rows), so the per-token
cross-entropy of transformers' logits on the probe is what megatron computes on any layout
that keeps that padding: a wrong mapping (a row order, a swapped pair of tensors) is refused
at the first resume. The device "cpu/hf" makes the loader use the tolerance between
implementations (engine/proof.TOLERANCE). The `param` digests are those of the weights the
import writes (the mapped ones: a wrong mapping gets them wrong alike, the losses catch it):
they check each load's placement of them exactly, also on layouts that pad the vocabulary
otherwise, where the losses do not compare.
"""

from typing import List, Optional

import numpy as np

from megatron_ucp.convert import hf_map
from megatron_ucp.engine import proof
from megatron_ucp.errors import ConfigError

DEVICE = "cpu/hf"
# The probe's length is kept a multiple of this: any TP and 2 x CP of 1, 2, 4, 8 splits it.
MULTIPLE = 8
# transformers holds the model in fp32 and its load buffers beside it.
_MEMORY_FACTOR = 3


def weight_bytes(model: hf_map.Model) -> int:
    return sum(4 * _numel(p.shape) for p in hf_map.pairs(model))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def unavailable(model: hf_map.Model) -> Optional[str]:
    """Why this machine cannot run the HF model (then the import records no proof), or None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed: pip install 'megatron-ucp[hf]'"
    import psutil

    need, free = _MEMORY_FACTOR * weight_bytes(model), psutil.virtual_memory().available
    if need > free:
        return f"running the HF model takes about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return None


def probe_for(model: hf_map.Model) -> proof.Probe:
    return proof.Probe(proof.probe_length(min(proof.MAX_PROBE_TOKENS, model.max_position_embeddings), MULTIPLE),
                       model.vocab_size)


def hf_losses(hf_dir: str, probe: proof.Probe) -> List[float]:
    """The per-token losses of `probe` through transformers' model of `hf_dir` (local
    safetensors files only, no remote code), fp32, eval mode."""
    import torch
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the import's own bar says how it goes
    try:
        net = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True,
                                                                use_safetensors=True, trust_remote_code=False)
    except Exception as e:  # transformers' own refusal of a folder the import took
        first = str(e).splitlines()[0] if str(e) else repr(e)
        raise ConfigError(f"{hf_dir}: transformers cannot load it: {first}") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    net.float().eval()
    ids = probe.ids()
    with torch.no_grad():
        logits = net(ids[:, :-1]).logits[0].float()
        losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    del net
    return [float(v) for v in losses.tolist()]


def param_digests(model: hf_map.Model, read) -> dict:
    """{"<atomic name>|param": [digest, scale]} of the fp32 weights the import writes, one
    atomic tensor at a time; `read(hf_name)` gives a HF tensor as float32 numpy."""
    import torch

    out = {}
    for p in hf_map.pairs(model):
        data = torch.from_numpy(np.ascontiguousarray(p.join(*[read(h) for h in p.hf]), np.float32))
        digest, scale = proof.box_digest(p.megatron, "", tuple(p.shape), (0,) * data.dim(), data)
        out[f"{p.megatron}|param"] = [proof.finite(digest), proof.finite(scale)]
    return out


def record(hf_dir: str, model: hf_map.Model, read) -> dict:
    """The proof record of the checkpoint an import of `hf_dir` (`model`, its tensors by `read`) writes."""
    digests = param_digests(model, read)
    probe = probe_for(model)
    return proof.source_record(probe, DEVICE, model.vocab_size, hf_losses(hf_dir, probe), digests)
