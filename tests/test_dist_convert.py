"""The streaming torch_dist converter's pieces, in-process: the DCP box reader on a real DCP
checkpoint, and the pipeline-stage placement rule. The conversions themselves are in the resume
matrix (bitwise against direct universal saves)."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.convert.dcp_reader import DcpReader
from megatron_ucp.convert.torch_dist_buckets import _stage_members
from megatron_ucp.errors import FormatError, IncompleteCheckpointError

pytestmark = pytest.mark.core_subset  # CI runs these on megatron-core 0.19 too (.ci/run)


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    d = tmp_path_factory.mktemp("dcp")
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(6, 5, 4, generator=g), "v": torch.randn(7, generator=g),
          "half": torch.randn(3, generator=g).bfloat16()}
    dcp.save(sd, checkpoint_id=str(d), no_dist=True)
    return d, sd


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_read_box_returns_the_box(dcp_dir, data):
    d, sd = dcp_dir
    reader = DcpReader(str(d))
    shape = tuple(sd["w"].shape)
    lo = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(1, n - o)) for o, n in zip(lo, shape)]
    got = reader.read_box("w", lo, sizes)
    want = sd["w"][tuple(slice(o, o + n) for o, n in zip(lo, sizes))].numpy()
    assert got.shape == want.shape and np.array_equal(got, want)
    reader.close()


def test_read_box_refuses_what_it_cannot_read(dcp_dir, tmp_path):
    d, _ = dcp_dir
    reader = DcpReader(str(d))
    with pytest.raises(FormatError, match="bfloat16"):
        reader.read_box("half", (0,), (3,))
    with pytest.raises(FormatError, match=r"'v' has shape \[7\]"):
        reader.read_box("v", (5,), (3,))
    with pytest.raises(FormatError, match="no tensor 'missing'"):
        reader.read_box("missing", (0,), (1,))
    reader.close()
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        DcpReader(str(tmp_path))
    # A data file gone: the error names it.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    victim = next(f for f in os.listdir(broken) if f.endswith(".distcp"))
    os.remove(broken / victim)
    with pytest.raises(IncompleteCheckpointError, match=victim):
        DcpReader(str(broken)).read_box("w", (0, 0, 0), (1, 1, 1))


@given(pp=st.integers(1, 4), vpp=st.sampled_from([None, 2, 3]), per_chunk=st.integers(1, 3))
def test_every_parameter_lives_on_exactly_one_pipeline_chunk(pp, vpp, per_chunk):
    layers = pp * (vpp or 1) * per_chunk
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    names += [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(layers)]
    chunks = [(r, c) for r in range(pp) for c in range(vpp or 1)]
    for name in names:
        homes = [rc for rc in chunks if _stage_members(name, layers, pp, rc[0], vpp, rc[1])]
        assert len(homes) == 1, (name, homes)
        if name.startswith("embedding"):
            assert homes == [(0, 0)]
        elif not name.startswith("decoder.layers"):
            assert homes == [(pp - 1, (vpp or 1) - 1)]


@given(tp=st.integers(1, 4), pp=st.integers(1, 4), ep=st.integers(1, 4), etp=st.integers(1, 4),
       dp=st.integers(1, 3), experts=st.booleans())
def test_optimizer_domains_number_every_model_parallel_rank_once(tp, pp, ep, etp, dp, experts):
    from types import SimpleNamespace

    from megatron_ucp.convert.torch_dist_buckets import _domains
    from megatron_ucp.errors import LayoutError

    world = tp * pp * dp * (ep if experts else 1) * (etp if experts else 1)
    source = SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                             num_experts=8 if experts else None)
    reader = SimpleNamespace(dir="ckpt")
    if experts and ep == 1 and etp != tp:
        with pytest.raises(LayoutError, match="--via-megatron"):
            _domains(reader, source, world)
        return
    domains = _domains(reader, source, world)
    assert [d.members for d in domains] == (["dense", "experts"] if experts and ep > 1 else ["all"])
    for d in domains:
        groups = [g for g, *_ in d.ranks]
        assert sorted(groups) == list(range(len(groups)))
        coords = {(r, t, e) for _, r, t, e in d.ranks}
        assert len(coords) == len(groups)
        assert d.dp * len(groups) == world  # data parallelism takes the remaining ranks


def test_common_state_from_common_pt_or_from_inside_the_dcp_files(dcp_dir, tmp_path):
    """megatron-core 0.16 writes the common state to common.pt, 0.19 as the object
    'common_state' inside the DCP files: read_common finds either, and names what is missing."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from megatron_ucp.convert.dcp_reader import COMMON_STATE, read_common

    def save_object(directory, obj):  # as megatron's sharded object: one torch.save'd list
        dcp.save({"w": torch.zeros(2), COMMON_STATE: obj}, checkpoint_id=str(directory), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))

    d, _ = dcp_dir
    with pytest.raises(IncompleteCheckpointError, match="common_state"):
        read_common(str(d))  # DCP files without it
    with pytest.raises(IncompleteCheckpointError, match="common.pt: missing"):
        read_common(str(tmp_path))
    save_object(tmp_path / "inside", [{"iteration": 3, "args": {"num_layers": 2}}])
    assert read_common(str(tmp_path / "inside")) == {"iteration": 3, "args": {"num_layers": 2}}
    legacy = tmp_path / "legacy"
    shutil.copytree(d, legacy)
    torch.save({"iteration": 5}, legacy / "common.pt")
    assert read_common(str(legacy)) == {"iteration": 5}
    save_object(tmp_path / "wrong", [[1, 2], [3]])
    with pytest.raises(FormatError, match="expected a dict"):
        read_common(str(tmp_path / "wrong"))
