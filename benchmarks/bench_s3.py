"""Object-store benchmark: a universal save and a resharded load through a loopback S3 endpoint
(moto's server behind tests/s3_server.py's proxy, on 127.0.0.1) against the same checkpoint on
local disk, in one run (by hand, not in CI).

    python benchmarks/bench_s3.py [--hidden-size 256 --num-layers 4 --vocab-size 16000]
        [--nproc 4] [--workdir DIR] [--json out.json]

One group of `--nproc` CPU processes trains TP2 x PP(nproc/2) with the distributed optimizer
for 2 iterations twice (same seed, same state), saving once to a folder and once to s3://bench/A
(boto3); where multi-storage-client is installed (the msc extra, the megatron-core 0.19 venv),
a third time to msc://bench/M, NVIDIA's Multi-Storage Client over the same endpoint and bucket:
the two clients compared on the same store. A second group resumes each on TP1 x DP(nproc)
with --ckpt-read-policy once. The
times are the loop's own ("saved checkpoint ... in X s", "resumed iteration 2 in X s"); the
proxy counts the requests and the body bytes the store answered during the s3 load, against
the checkpoint's tensor bytes (headers excluded) and its bytes in all. moto keeps objects in
this process's memory: the s3 numbers are the protocol's cost (requests, bytes, the client),
not a real network's.
"""

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from harness import BASE, ok, run_steps  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402


def _model(args) -> list:
    argv = list(BASE)
    for flag, value in (("--hidden-size", args.hidden_size), ("--num-layers", args.num_layers),
                        ("--vocab-size", args.vocab_size), ("--num-attention-heads", 8)):
        argv[argv.index(flag) + 1] = str(value)
    return argv + ["--use-distributed-optimizer"]


def _msc_profile(work: Path, url: str) -> str:
    """A Multi-Storage Client profile "bench" over the loopback endpoint's bucket (as Megatron-LM's
    --enable-msc reads one); the path of its config file."""
    config = work / "msc_config.json"
    config.write_text(json.dumps({"profiles": {"bench": {
        "storage_provider": {"type": "s3", "options": {"base_path": "bench", "endpoint_url": url,
                                                       "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials",
                                 "options": {"access_key": "testing", "secret_key": "testing"}}}}}))
    return str(config)


def _seconds(pattern: str, text: str) -> float:
    found = re.findall(pattern, text)
    assert found, f"no line matching {pattern!r} in:\n{text[-2000:]}"
    return float(found[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--workdir")
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ucp-bench-s3-"))
    model, n = _model(args), args.nproc
    save_layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", str(n // 2)]
    local = str(work / "A")
    targets = {"disk": local, "s3": "s3://bench/A"}
    with s3_endpoint() as (url, faults, env):
        os.environ.update(env)
        import boto3

        boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"]).create_bucket(Bucket="bench")
        if importlib.util.find_spec("multistorageclient") is not None:
            os.environ["MSC_CONFIG"] = _msc_profile(work, url)
            targets["msc"] = "msc://bench/M"
        train = lambda name, extra, **kw: {"name": name, "op": "train", "argv": model + extra + [  # noqa: E731
            "--train-iters", str(kw["iters"])] + kw.get("more", [])}
        # one group per target, so that the proxy's counts are that client's alone
        saved, puts = {}, {}
        for where, path in targets.items():
            faults.seen.clear(), faults.served.clear()
            saved.update(run_steps(n, [train(f"save_{where}", save_layout, iters=2,
                                             more=["--save", path, "--save-interval", "2"])],
                                   work / f"save_{where}", timeout=3600))
            puts[where] = dict(faults.seen)
        loaded, gets, served = {}, {}, {}
        for where, path in targets.items():
            faults.seen.clear(), faults.served.clear()
            loaded.update(run_steps(n, [train(f"load_{where}", [], iters=3, more=[
                "--load", path, "--ckpt-step", "2", "--load-universal", "--ckpt-read-policy", "once"])],
                work / f"load_{where}", timeout=3600))
            gets[where], served[where] = dict(faults.seen), faults.served.get("GET", 0)
    from megatron_ucp.format import manifest as mf
    from megatron_ucp.format.tensor_entry import file_layout

    m = mf.read_manifest(f"{local}/iter_{2:07d}")
    tensor_bytes = sum(file_layout(e).file_size - len(file_layout(e).header) for e in m.tensors.values())
    total_bytes = sum(f.stat().st_size for f in Path(local, f"iter_{2:07d}").rglob("*") if f.is_file())
    out = {
        "model": {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "vocab_size": args.vocab_size,
                  "ranks": n, "checkpoint_bytes": total_bytes, "tensor_bytes": tensor_bytes,
                  "objects": sum(1 for f in Path(local, f"iter_{2:07d}").rglob("*") if f.is_file())},
        "save_s": {w: _seconds(r"saved checkpoint at iteration\s+2 to \S+ \(universal\) in ([0-9.]+) s",
                               ok(saved, f"save_{w}")["stdout"]) for w in targets},
        "load_s": {w: _seconds(r"resumed iteration 2 in ([0-9.]+) s", ok(loaded, f"load_{w}")["stdout"])
                   for w in targets},
    }
    for w in targets:
        if w != "disk":
            out[f"save_requests_{w}"], out[f"load_requests_{w}"] = puts[w], gets[w]
            out[f"load_bytes_answered_{w}"] = served[w]
            out[f"bytes_answered_per_tensor_byte_{w}"] = round(served[w] / tensor_bytes, 4)
    out["ratios_to_disk"] = {f"{what}_{w}": round(out[f"{what}_s"][w] / out[f"{what}_s"]["disk"], 2)
                             for what in ("save", "load") for w in targets if w != "disk"}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
