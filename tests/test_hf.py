"""Hugging Face export and import (tools/export_hf.py, tools/import_hf.py): megatron's logits and
transformers' agree, on several layouts, for models trained here and random HF models made here.

All megatron runs share one torchrun group of 4 CPU processes (tests/runner.py); transformers
runs in the test process. Nothing is downloaded: every model is tiny and made by the test.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it (run.sh)
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from harness import REPO, ok, run_steps  # noqa: E402
from megatron_ucp.convert import hf_map  # noqa: E402
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError  # noqa: E402
from megatron_ucp.convert.hf import export, import_  # noqa: E402

TOL = 1e-4
SEQ = 16
TOKENS = torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(3)).tolist()
RUN = ["--cpu", "--mock-data", "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "8",
       "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7", "--log-interval", "1000"]
LLAMA = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "250",
         "--make-vocab-size-divisible-by", "32", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--group-query-attention",
         "--num-query-groups", "2"]
UNTIED = ["--untie-embeddings-and-output-weights"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "250"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
LAYOUTS = {"tp1": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}
HF_SIZES = dict(vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)


def hf_random(kind: str, folder: Path) -> Path:
    """A random tiny HF model saved in fp32 (Qwen2 with its QKV biases randomised too: HF
    initialises biases to zero, which would hide a misplaced bias row)."""
    torch.manual_seed({"llama": 1, "qwen2": 2, "mixtral": 3}[kind])
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES, rope_theta=5000.0))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_SIZES, tie_word_embeddings=True))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0, 0.5)
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF_SIZES, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    model.float().save_pretrained(folder)
    return folder


def hf_logits(folder) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def tool(name: str, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *map(str, args), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300)


def flags_of(ckpt: Path) -> list:
    """The model flags an imported checkpoint's manifest stores."""
    m = json.loads((ckpt / "iter_0000000" / "ucp.json").read_text())
    return hf_map.megatron_args(hf_map.from_checkpoint(m["architecture"], m["args"], m["tensors"]))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def imported(work):
    """Random HF Llama (untied), Qwen2 (tied, QKV biases) and Mixtral, imported (Llama by the tool)."""
    out = {}
    for kind in ("llama", "qwen2", "mixtral"):
        hf = hf_random(kind, work / f"hf_{kind}")
        if kind == "llama":
            proc = tool("import_hf.py", hf, work / f"u_{kind}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "model flags: --num-layers 4" in proc.stdout
            assert "resume proof recorded from transformers' run of the source: 64 probe tokens" in proc.stdout
        else:
            summary = import_(str(hf), str(work / f"u_{kind}"), progress=False)
            assert summary["proof"].startswith("resume proof recorded"), summary["proof"]
        out[kind] = (hf, work / f"u_{kind}")
    return out


@pytest.fixture(scope="module")
def group(work, imported):
    """Every megatron run: training to export, megatron's logits, fine-tuning from imports."""
    d = lambda name: str(work / name)  # noqa: E731

    def train(name, extra, iters, save=None, load=None):
        argv = RUN + extra + ["--train-iters", str(iters)]
        argv += ["--save", save, "--save-interval", str(iters)] if save else []
        argv += ["--load", load] if load else []
        return {"name": name, "op": "train", "argv": argv}

    def logits(name, extra, load):
        return {"name": name, "op": "logits", "argv": RUN + extra + ["--train-iters", "1", "--load", load],
                "tokens": TOKENS}

    steps = [
        train("x_untied", LLAMA + UNTIED + TP2PP2, 5, save=d("X_untied")),
        train("x_tied", LLAMA + TP2PP2, 5, save=d("X_tied")),
        train("x_moe", LLAMA + UNTIED + MOE + ["--expert-model-parallel-size", "2"], 5, save=d("X_moe")),
        train("x_gpt", GPT, 1, save=d("X_gpt")),  # LayerNorm, GELU, learned positions, biases
        logits("l_untied", LLAMA + UNTIED + TP2PP2, d("X_untied")),
        logits("l_tied", LLAMA + TP2PP2, d("X_tied")),
        logits("l_moe", LLAMA + UNTIED + MOE + ["--expert-model-parallel-size", "2"], d("X_moe")),
        logits("i_mixtral_ep2", flags_of(imported["mixtral"][1]) + ["--expert-model-parallel-size", "2"],
               str(imported["mixtral"][1])),
        # Fine-tuning: from an import on two layouts, and from a trained checkpoint (with optimizer).
        train("f_llama_tp2", flags_of(imported["llama"][1]) + LAYOUTS["tp2"] + ["--finetune"], 5,
              save=d("F_llama"), load=str(imported["llama"][1])),
        train("f_qwen2_pp2", flags_of(imported["qwen2"][1]) + LAYOUTS["pp2"] + ["--finetune"], 5,
              load=str(imported["qwen2"][1])),
        train("f_trained", LLAMA + UNTIED + ["--finetune"], 3, load=d("X_untied")),
    ]
    for kind in ("llama", "qwen2"):
        for layout, extra in LAYOUTS.items():
            steps.append(logits(f"i_{kind}_{layout}", flags_of(imported[kind][1]) + extra, str(imported[kind][1])))
    # No model flags: --use-checkpoint-args takes them from the manifest's args.
    steps.append(logits("i_qwen2_checkpoint_args", ["--use-checkpoint-args"], str(imported["qwen2"][1])))
    # Last: megatron's torch_dist writer leaves threads behind that slow later steps.
    dist_format = LLAMA + UNTIED + ["--ckpt-format", "torch_dist"]
    steps += [train("n_dist", dist_format, 5, save=d("N_dist")),
              train("f_dist", dist_format + ["--finetune"], 3, load=d("N_dist"))]
    return run_steps(4, steps, work / "w4")


def max_diff(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{a.shape} != {b.shape}"
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("kind", ["untied", "tied", "moe"])
def test_export_logits(work, group, kind):
    """A model trained 5 iterations (TP2xPP2, or EP2 for the MoE) exported: transformers' logits are
    megatron's; the files load with safetensors alone."""
    ok(group, f"x_{kind}")
    out = work / f"hf_export_{kind}"
    if kind == "untied":  # the command line, cut into several shards
        proc = tool("export_hf.py", work / "X_untied", out, "--max-shard-gb", "0.00005")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "exported iteration 5 as LlamaForCausalLM" in proc.stdout
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        loaded = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
        assert set(loaded) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in loaded.values())
    else:
        export(str(work / f"X_{kind}"), str(out), progress=False)
        loaded = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"moe": "MixtralForCausalLM"}.get(kind, "LlamaForCausalLM")]
    assert loaded["model.embed_tokens.weight"].shape == (250, 32)  # padding rows dropped
    assert ("lm_head.weight" in loaded) == (kind != "tied")
    diff = max_diff(hf_logits(out), ok(group, f"l_{kind}")["logits"])
    print(f"export {kind}: max abs logit difference {diff:.3g}")
    assert diff <= TOL


def test_export_bf16(work, group):
    """--dtype bf16 writes BF16 tensors, the fp32 ones rounded to nearest even."""
    ok(group, "x_untied")
    export(str(work / "X_untied"), str(work / "hf_bf16"), dtype="bf16", progress=False)
    export(str(work / "X_untied"), str(work / "hf_fp32"), progress=False)
    from safetensors.torch import load_file as load_torch

    half, full = load_torch(str(work / "hf_bf16" / "model.safetensors")), load_file(str(work / "hf_fp32" / "model.safetensors"))
    assert half.keys() == full.keys()
    for k, v in half.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, torch.from_numpy(full[k]).to(torch.bfloat16)), k
    assert json.loads((work / "hf_bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_logits(imported, group, kind, layout):
    """A random HF model imported: megatron's logits on TP1, TP2 and PP2 are transformers'."""
    diff = max_diff(ok(group, f"i_{kind}_{layout}")["logits"], hf_logits(imported[kind][0]))
    print(f"import {kind} {layout}: max abs logit difference {diff:.3g}")
    assert diff <= TOL
    assert proof_delta(ok(group, f"i_{kind}_{layout}")) <= 1e-5  # transformers' losses, recorded at import


def proof_delta(result: dict) -> float:
    """How far megatron's probe losses were from those the import recorded (the load's line)."""
    found = re.search(r"resume proof passed: 64 probe tokens within (\S+) of the saved losses "
                      r"\(tolerance 0\.001\), (\d+) state digests equal", result.get("proof") or "")
    assert found, result.get("proof")
    print(f"  {result['proof']}")
    return float(found.group(1))


@pytest.mark.parametrize("kind,step", [("mixtral", "i_mixtral_ep2"), ("qwen2", "i_qwen2_checkpoint_args")])
def test_import_logits_more(imported, group, kind, step):
    """Mixtral on EP2; Qwen2 built from the flags its manifest stores (--use-checkpoint-args)."""
    diff = max_diff(ok(group, step)["logits"], hf_logits(imported[kind][0]))
    print(f"import {step}: max abs logit difference {diff:.3g}")
    assert diff <= TOL
    assert proof_delta(ok(group, step)) <= 1e-5


def _prove(ckpt: Path) -> subprocess.CompletedProcess:
    """`inspect --verify --prove`: the checkpoint loaded in one CPU process, its proof checked."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_ucp", "inspect", str(ckpt), "--verify", "--prove"],
                          capture_output=True, text=True, env=env, timeout=300)


def test_import_proof_refuses_a_wrong_state(work, imported):
    """Two layers' fc1 weights swapped in an import (checksums redone): the load names the tensor
    by its digest."""
    import meaning_faults as faults

    bad = work / "u_llama_swapped"
    shutil.copytree(imported["llama"][1], bad)
    it = bad / "iter_0000000"
    a, b = (f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1))
    fc1_a, fc1_b = faults.read_state(it, a), faults.read_state(it, b)
    faults.write_state(it, a, "param", fc1_b)
    faults.write_state(it, b, "param", fc1_a)
    proc = _prove(bad)
    assert proc.returncode == 1 and "fails its resume proof" in proc.stdout, proc.stdout + proc.stderr
    assert f"tensor '{a}' param: digest" in proc.stdout, proc.stdout


def _import_refused(work, imported, monkeypatch, mapping: str, wrong, out: str):
    """An import with `mapping` of hf_map replaced by `wrong` is refused by its proof in one
    process (`inspect --verify --prove`), naming a probe token."""
    monkeypatch.setattr(hf_map, mapping, wrong)
    import_(str(imported["llama"][0]), str(work / out), progress=False)
    monkeypatch.undo()
    proc = _prove(work / out)
    assert proc.returncode == 1 and "fails its resume proof" in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"probe token \d+: loss \S+ saved, \S+ now", proc.stdout), proc.stdout


def test_import_proof_refuses_a_wrong_mapping(work, imported, monkeypatch):
    """An importer that fuses Q, K and V as thirds (not per query group, megatron's order) writes
    weights whose digests it records alike: transformers' losses, recorded from the source, refuse
    it at the first load, naming a probe token."""
    _import_refused(work, imported, monkeypatch, "qkv_from_hf",
                    lambda q, k, v, groups: np.concatenate([q, k, v]), "u_llama_thirds")
    proc = _prove(imported["llama"][1])  # the right mapping passes, in one process too
    assert proc.returncode == 0 and "resume proof passed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow  # run by hand (CI time): test_import_proof_refuses_a_wrong_mapping is the CI's
def test_import_proof_refuses_gate_and_up_swapped(work, imported, monkeypatch):
    """SwiGLU's gate and up halves swapped in every layer: on these random models the worst
    probe token moves by 4e-3 only, which fp32 on the CPU (1e-6 from transformers) still tells
    from layout noise (proof.loss_tolerance: same kind of device, fp32 on both sides)."""
    _import_refused(work, imported, monkeypatch, "fc1_from_hf",
                    lambda gate, up: np.concatenate([up, gate], axis=0), "u_llama_up_gate")


def test_import_without_proof(work, imported):
    """--no-proof: none recorded, said in one line."""
    proc = tool("import_hf.py", imported["qwen2"][0], work / "u_qwen2_unproved", "--no-proof")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume proof not recorded (--no-proof)" in proc.stdout, proc.stdout
    assert "proof" not in json.loads((work / "u_qwen2_unproved" / "iter_0000000" / "ucp.json").read_text())


def test_import_proof_skipped_where_transformers_cannot_run(work, imported, monkeypatch):
    """Without transformers, or with less free memory than 3x the fp32 weights: the import is
    written without a proof, and its summary says why in one line."""
    import psutil

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    s = import_(str(imported["llama"][0]), str(work / "u_no_transformers"), progress=False)
    assert s["proof"] == "resume proof not recorded (transformers is not installed: pip install 'megatron-ucp[hf]')"
    monkeypatch.undo()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 10**5})())
    s = import_(str(imported["llama"][0]), str(work / "u_no_memory"), progress=False)
    assert s["proof"].startswith("resume proof not recorded (running the HF model takes about"), s["proof"]
    for name in ("u_no_transformers", "u_no_memory"):
        assert "proof" not in json.loads((work / name / "iter_0000000" / "ucp.json").read_text())


def test_import_manifest(imported):
    """Weights only, iteration 0, no RNG; the architecture is the one the stored flags build (the
    loads above check it against megatron's model)."""
    from megatron_ucp.format.manifest import read_manifest

    m = read_manifest(str(imported["llama"][1] / "iter_0000000"))
    assert (m.iteration, m.consumed_samples, m.optimizer, m.scheduler) == (0, 0, None, None)
    assert m.rng_saved is False and all(e.states == ("param",) for e in m.tensors.values())
    assert m.args["rotary_base"] == 5000 and m.args["untie_embeddings_and_output_weights"] is True


def test_finetune(work, group):
    """--finetune trains from the weights: iterations count from 1, the loss falls, a save is at
    iteration 5 with 5 global batches consumed; from trained checkpoints too (universal, torch_dist),
    whose first loss is the trained model's, not a fresh one's; the imports' resume proofs pass."""
    from megatron_ucp.format.manifest import read_manifest

    for name, iters in (("f_llama_tp2", 5), ("f_qwen2_pp2", 5), ("f_trained", 3), ("f_dist", 3)):
        losses = {int(k): v for k, v in ok(group, name)["losses"].items()}
        assert sorted(losses) == list(range(1, iters + 1)), (name, sorted(losses))
        print(f"finetune {name}: loss {losses[1]:.4f} -> {losses[iters]:.4f}")
        assert losses[iters] < losses[1] - 0.05, (name, losses)
        source = {"f_trained": "x_untied", "f_dist": "n_dist"}.get(name)
        if source:  # weights loaded: the first loss is well below that of the source's fresh start
            fresh = ok(group, source)["losses"]["1"]
            assert losses[1] < fresh - 0.2, (name, losses[1], fresh)
        else:  # from an import: its proof (transformers' losses) passed on TP2 and PP2
            assert "resume proof passed: 64 probe tokens" in ok(group, name)["stdout"], name
    m = read_manifest(str(work / "F_llama" / "iter_0000005"))
    assert m.consumed_samples == 40 and m.optimizer["step"] == 5


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_round_trip_bitwise(work, imported, kind):
    """HF -> universal -> HF gives back every tensor, bit for bit, under the same names."""
    hf, ucp = imported[kind]
    out = work / f"rt_{kind}"
    export(str(ucp), str(out), progress=False)
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32 and np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)), k


def test_export_refuses_gpt(work, group):
    """A LayerNorm + GELU GPT with learned positions and biases: refused, naming each difference."""
    ok(group, "x_gpt")
    proc = tool("export_hf.py", work / "X_gpt", work / "hf_gpt")
    assert proc.returncode == 2
    for what in ("normalization LayerNorm", "no SwiGLU", "learned_absolute", "linear biases"):
        assert what in proc.stderr, proc.stderr
    assert not (work / "hf_gpt").exists()


ARCH = hf_map.architecture(hf_map.Model("llama", 2, 32, 48, 4, 2, 8, 250, 1e-6, 10000, False, 64))
ARGS = {"rotary_base": 10000, "norm_epsilon": 1e-6, "moe_router_topk": 2}
MOE_ARCH = dict(ARCH, num_experts=4, moe_ffn_hidden_size=48, moe_layer_pattern=[1, 1])


@pytest.mark.parametrize("arch,args,named", [
    (dict(ARCH, normalization="LayerNorm"), ARGS, "normalization LayerNorm"),
    (dict(ARCH, position_embedding_type="learned_absolute"), ARGS, "learned_absolute"),
    (dict(ARCH, add_bias_linear=True), ARGS, "linear biases"),
    (dict(ARCH, qk_layernorm=True), ARGS, "QK layernorm"),
    (ARCH, dict(ARGS, rope_type="yarn"), "rope_type 'yarn'"),
    (ARCH, {"norm_epsilon": 1e-6}, "lack 'rotary_base'"),
    (MOE_ARCH, dict(ARGS, moe_router_score_function="sigmoid"), "router score function 'sigmoid'"),
    (dict(MOE_ARCH, moe_shared_expert_intermediate_size=16), ARGS, "a shared expert"),
    (dict(MOE_ARCH, moe_layer_pattern=[0, 1]), ARGS, "dense layers among MoE"),
    (MOE_ARCH, dict(ARGS, moe_router_enable_expert_bias=True), "router expert bias"),
    (MOE_ARCH, dict(ARGS, moe_expert_capacity_factor=1.0), "expert capacity factor"),
    (ARCH, dict(ARGS, use_rope_scaling=True), "use_rope_scaling"),
])
def test_export_refuses(arch, args, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        hf_map.from_checkpoint(arch, args, [])


def test_mapping_round_trips():
    """The QKV and fc1 reorderings invert each other; the fused rows are per query group."""
    q, k, v = (np.arange(n * 3, dtype=np.float32).reshape(n, 3) + o for n, o in ((8, 0), (4, 100), (4, 200)))
    fused = hf_map.qkv_from_hf(q, k, v, groups=2)
    assert np.array_equal(fused[:8], np.concatenate([q[:4], k[:2], v[:2]]))  # group 0: 2 query heads, k, v
    for a, b in zip(hf_map.qkv_to_hf(fused, heads=4, groups=2, head_dim=2), (q, k, v)):
        assert np.array_equal(a, b)
    gate, up = np.ones((3, 2)), np.zeros((3, 2))
    assert all(np.array_equal(a, b) for a, b in zip(hf_map.fc1_to_hf(hf_map.fc1_from_hf(gate, up)), (gate, up)))


def _copy_hf(src: Path, dst: Path, config=None, drop=None, tensors=None) -> Path:
    """A HF folder like `src` with its config changed, a tensor dropped, or tensors replaced."""
    from safetensors.numpy import save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    t = load_file(str(src / "model.safetensors"))
    t.pop(drop, None)
    t.update(tensors or {})
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_import_bad_input(work, imported):
    src = imported["llama"][0]
    bad = _copy_hf(src, work / "bad_arch", config={"architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(ConfigError, match="GPTNeoXForCausalLM"):
        import_(str(bad), str(work / "out_arch"), progress=False)
    bad = _copy_hf(src, work / "bad_missing", drop="model.layers.2.mlp.up_proj.weight")
    with pytest.raises(IncompleteCheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        import_(str(bad), str(work / "out_missing"), progress=False)
    bad = _copy_hf(src, work / "bad_shape", config={"intermediate_size": 40})
    with pytest.raises(FormatError, match=r"mlp\.gate_proj\.weight' has shape \[48, 32\], config.json implies \[40, 32\]"):
        import_(str(bad), str(work / "out_shape"), progress=False)
    bad = _copy_hf(src, work / "bad_extra", tensors={"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
    with pytest.raises(FormatError, match=r"q_proj\.bias' has no place"):
        import_(str(bad), str(work / "out_extra"), progress=False)
    bad = _copy_hf(src, work / "bad_rope", config={"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ConfigError, match="rope scaling"):
        import_(str(bad), str(work / "out_rope"), progress=False)
    fifo = _copy_hf(src, work / "bad_fifo")  # a shard that is a FIFO would block safetensors forever
    for f in fifo.glob("*.safetensors"):
        f.unlink()
        os.mkfifo(f)
    with pytest.raises(FormatError, match=r"\.safetensors is a FIFO, expected a regular file"):
        import_(str(fifo), str(work / "out_fifo"), progress=False)
    assert not any((work / f"out_{w}").exists() for w in ("arch", "missing", "shape", "extra", "rope", "fifo"))
