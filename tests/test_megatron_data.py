"""--data-path through megatron-core's GPTDataset, validation loss and TensorBoard scalars.

The corpus is two indexed datasets written with megatron-core's builder: documents of a learnable
recurrence (so the loss falls) over disjoint token ranges, each ended by the NullTokenizer's EOD.
"""

import argparse
import json

import numpy as np
import pytest
import torch

from harness import BASE, losses, ok, run_steps
from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.flag_validation import validate
from megatron_ucp.mcore.flags import build_parser
from megatron_ucp.train.data import build_gpt_datasets, microbatches, split_sizes

VOCAB = 250  # --vocab-size: tokens 0..249, EOD 250, the model's vocabulary 251
RANGES = {"A": 0, "B": 100}  # prefix A uses ids 0..63, B ids 100..163


def write_corpus(prefix, seed, low, documents=200, period=64):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(documents):
        x, doc = int(rng.integers(period)), []
        for _ in range(int(rng.integers(5, 60))):
            doc.append(low + x)
            x = (5 * x + 7) % period if rng.random() > 1 / 16 else int(rng.integers(period))
        builder.add_item(torch.tensor(doc + [VOCAB]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for seed, (name, low) in enumerate(RANGES.items()):
        write_corpus(root / name, seed, low)
    return root


@pytest.fixture(scope="module")
def process_group():
    """megatron's BlendedDataset asks for the rank when it caches its indices."""
    import torch.distributed as dist

    from harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def data_args(corpus, *extra):
    argv = [a for a in BASE if a != "--mock-data"] + [
        "--data-path", "0.5", str(corpus / "A"), "0.5", str(corpus / "B"), "--split", "90,5,5",
        "--tokenizer-type", "NullTokenizer", "--train-iters", "10", "--eval-interval", "5",
        "--eval-iters", "2", *extra]
    return validate(build_parser().parse_args(argv), 1)


# ---------------------------------------------------------------- in one process


def test_null_tokenizer_adds_eod_to_the_vocabulary_once(corpus):
    args = data_args(corpus)
    assert (args.eod_token, args.vocab_size) == (VOCAB, VOCAB + 1)
    validate(args, 1)
    assert args.vocab_size == VOCAB + 1
    with pytest.raises(ConfigError, match="--tokenizer-type NullTokenizer"):
        validate(build_parser().parse_args(["--data-path", str(corpus / "A")]), 1)


def test_split_sizes_are_megatron_lms(corpus):
    # train_iters * gbs; (train_iters // eval_interval + 1) * eval_iters * gbs; eval_iters * gbs
    assert split_sizes(data_args(corpus)) == [80, 48, 16]


def test_samples_are_a_pure_function_of_data_and_seed(corpus, tmp_path, process_group):
    one, valid = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path / "a")))
    two, _ = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path / "b")))
    other, _ = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path / "c"),
                                            "--seed", "8"))
    assert list((tmp_path / "a").glob("*GPTDataset-train-shuffle_index.npy"))
    for i in range(0, 80, 7):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(one[i][key], two[i][key]), (i, key)
    assert any(not torch.equal(one[i]["tokens"], other[i]["tokens"]) for i in range(10))
    # Both prefixes are blended in, documents are shuffled (not file order), EOD is kept.
    firsts = [int(one[i]["tokens"][0]) for i in range(80)]
    assert any(t < 100 for t in firsts) and any(100 <= t < VOCAB for t in firsts)
    assert any(bool((one[i]["tokens"] == VOCAB).any()) for i in range(80))
    # The validation split holds other documents (of both prefixes) than the training one.
    for train_part, valid_part in zip(one.dataset.datasets, valid.dataset.datasets):
        assert len(valid_part.indices) and not set(train_part.indices) & set(valid_part.indices)


def test_global_batch_is_the_same_whatever_the_dp_layout(corpus, tmp_path, process_group):
    train, _ = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path)))

    def global_batch(dp, mbs):
        rows = {}
        for r in range(dp):
            for m, b in enumerate(microbatches(train, 16, 8, mbs, r, dp)):
                for k in range(mbs):
                    rows[(m, r, k)] = b["tokens"][k]
        return torch.stack([rows[key] for key in sorted(rows)])

    reference = global_batch(1, 8)
    assert torch.equal(reference[0], train[16]["tokens"])
    for dp, mbs in [(2, 2), (4, 1), (2, 4)]:
        assert torch.equal(global_batch(dp, mbs), reference), (dp, mbs)


def test_eod_mask_loss_and_reset_position_ids(corpus, tmp_path, process_group):
    train, _ = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path),
                                            "--eod-mask-loss", "--reset-position-ids"))
    i = next(i for i in range(80) if bool((train[i]["tokens"][:-1] == VOCAB).any()))
    s = train[i]
    eod = int((s["tokens"] == VOCAB).nonzero()[0])
    assert s["loss_mask"][eod] == 0 and s["loss_mask"].sum() == (s["tokens"] != VOCAB).sum()
    assert s["position_ids"][eod + 1] == 0 and s["position_ids"][eod] == eod


def test_reset_attention_mask_keeps_documents_apart(corpus, tmp_path, process_group):
    """Megatron-LM's --reset-attention-mask: a token after an EOD attends only to its own
    document (mask True = blocked, megatron's convention); causal within a document."""
    train, _ = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path),
                                            "--reset-attention-mask"))
    i = next(i for i in range(80) if bool((train[i]["tokens"][:-2] == VOCAB).any()))
    tokens, mask = train[i]["tokens"], train[i]["attention_mask"]
    assert mask.shape == (1, 16, 16) and mask.dtype == torch.bool
    mask = mask[0]
    eod = int((tokens == VOCAB).nonzero()[0])
    assert not mask[eod, : eod + 1].any() and mask[eod, eod + 1:].all()  # the EOD ends its document
    assert mask[eod + 1, : eod + 1].all() and not mask[eod + 1, eod + 1]  # the next one starts anew
    assert mask[eod + 2, : eod + 1].all() and not mask[eod + 2, eod + 1: eod + 3].any()
    batch = microbatches(train, 0, 8, 2, 0, 4)[0]
    assert batch["attention_mask"].shape == (2, 1, 16, 16)
    plain, _ = build_gpt_datasets(data_args(corpus, "--data-cache-path", str(tmp_path)))
    assert "attention_mask" not in plain[i] and torch.equal(plain[i]["tokens"], tokens)
    with pytest.raises(ConfigError, match="--reset-attention-mask needs --data-path"):
        validate(build_parser().parse_args(BASE + ["--reset-attention-mask"]), 1)


def test_bad_data_is_a_clear_error(corpus, tmp_path, process_group):
    with pytest.raises(ConfigError, match=r"nothere\.bin not found"):
        build_gpt_datasets(validate(build_parser().parse_args(
            ["--data-path", str(tmp_path / "nothere"), "--tokenizer-type", "NullTokenizer"]), 1))
    # 200 documents per prefix: "999,1,0" leaves validation none (megatron would loop forever).
    with pytest.raises(ConfigError, match=r"--split '999,1,0' leaves the validation split of .*A"):
        build_gpt_datasets(data_args(corpus, "--split", "999,1,0", "--data-cache-path",
                                     str(tmp_path)))
    # Megatron-LM's default split gives the test split no document; the run never reads it.
    args = data_args(corpus, "--split", "969,30,1", "--data-cache-path", str(tmp_path))
    args.eval_interval = None
    train, valid = build_gpt_datasets(args)
    assert valid is None and len(train) >= 80
    args = data_args(corpus, "--data-cache-path", str(tmp_path))
    args.vocab_size = 120  # B's ids (100..163) do not fit
    train, _ = build_gpt_datasets(args)
    message = r"token id (1[2-9]\d|250), outside the model's vocabulary of size 120 \(train sample"
    with pytest.raises(ValueError, match=message):
        for i in range(80):
            train[i]


def test_tensorboard_without_the_package_names_it(monkeypatch):
    import importlib.util

    from megatron_ucp.train import monitor

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs the `tensorboard` package"):
        monitor.tensorboard_writer("tb")


# ---------------------------------------------------------------- resumed on another layout


def scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def log_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_on_another_layout_continues_data_and_validation(corpus, tmp_path):
    argv = [a for a in BASE if a != "--mock-data"] + [
        "--data-path", "0.5", str(corpus / "A"), "0.5", str(corpus / "B"), "--split", "90,5,5",
        "--tokenizer-type", "NullTokenizer", "--data-cache-path", str(tmp_path / "cache"),
        "--eval-interval", "5", "--eval-iters", "2", "--train-iters", "10"]
    ckpt = str(tmp_path / "ckpt")
    steps = [
        {"name": "dp2", "op": "train", "argv": argv + [
            "--save", ckpt, "--save-interval", "5", "--loss-log", str(tmp_path / "dp2.jsonl"),
            "--tensorboard-dir", str(tmp_path / "tb_dp2")]},
        {"name": "tp2", "op": "train", "argv": argv + [
            "--tensor-model-parallel-size", "2", "--load", ckpt, "--ckpt-step", "5",
            "--load-universal", "--loss-log", str(tmp_path / "tp2.jsonl"),
            "--tensorboard-dir", str(tmp_path / "tb_tp2")]},
        {"name": "pp2", "op": "train", "argv": argv + [  # forward-only through the pipeline
            "--pipeline-model-parallel-size", "2", "--load", ckpt, "--ckpt-step", "5",
            "--load-universal", "--loss-log", str(tmp_path / "pp2.jsonl")]},
    ]
    results = run_steps(2, steps, tmp_path, timeout=600)
    reference, resumed = losses(results, "dp2"), losses(results, "tp2")
    ok(results, "tp2")
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    delta = max(abs(reference[i] - resumed[i]) for i in resumed)
    print(f"max |dloss| DP2 -> TP2 resume: {delta:.3g}")
    assert delta <= 1e-4, (reference, resumed)
    assert reference[10] < reference[1] - 0.5, reference  # it learns the documents

    def validation(name):
        return {r["iteration"]: r["validation_loss"]
                for r in log_lines(tmp_path / f"{name}.jsonl") if "validation_loss" in r}

    val_ref, val_resumed = validation("dp2"), validation("tp2")
    assert sorted(val_ref) == [5, 10] and sorted(val_resumed) == [10]
    print(f"validation losses {val_ref}, resumed {val_resumed}")
    assert abs(val_ref[10] - val_resumed[10]) <= 1e-4, (val_ref, val_resumed)
    pipelined = losses(results, "pp2")
    assert max(abs(reference[i] - pipelined[i]) for i in pipelined) <= 1e-4, (reference, pipelined)
    assert abs(val_ref[10] - validation("pp2")[10]) <= 1e-4, (val_ref, validation("pp2"))
    assert val_ref[10] < val_ref[5]

    tb = scalars(tmp_path / "tb_dp2")
    assert sorted(tb["lm loss"]) == list(range(1, 11))
    for it in range(1, 11):
        assert abs(tb["lm loss"][it] - reference[it]) <= 1e-5
    assert sorted(tb["learning-rate"]) == list(range(1, 11)) and tb["learning-rate"][3] == pytest.approx(5e-3)
    assert sorted(tb["grad-norm"]) == list(range(1, 11)) and tb["grad-norm"][1] > 0
    assert {k: round(v, 5) for k, v in tb["lm loss validation"].items()} == \
        {k: round(v, 5) for k, v in val_ref.items()}
    assert sorted(tb["save-checkpoint-seconds"]) == [5, 10]
    assert all(v > 0 for v in tb["save-checkpoint-seconds"].values())
    tb_resumed = scalars(tmp_path / "tb_tp2")
    assert sorted(tb_resumed["load-checkpoint-seconds"]) == [5]
    assert abs(tb_resumed["lm loss validation"][10] - val_ref[10]) <= 1e-4


def test_reset_attention_mask_reaches_attention_on_any_layout(corpus, tmp_path):
    """The document mask changes the losses (it reaches the core attention), and a run resumed
    on TP2 continues the DP2 run with it."""
    argv = [a for a in BASE if a != "--mock-data"] + [
        "--data-path", "0.5", str(corpus / "A"), "0.5", str(corpus / "B"), "--split", "90,5,5",
        "--tokenizer-type", "NullTokenizer", "--data-cache-path", str(tmp_path / "cache"),
        "--train-iters", "4"]
    ckpt = str(tmp_path / "ckpt")
    steps = [
        {"name": "plain", "op": "train", "argv": argv},
        {"name": "dp2", "op": "train", "argv": argv + [
            "--reset-attention-mask", "--save", ckpt, "--save-interval", "2"]},
        {"name": "tp2", "op": "train", "argv": argv + [
            "--reset-attention-mask", "--tensor-model-parallel-size", "2", "--load", ckpt,
            "--ckpt-step", "2", "--load-universal"]},
    ]
    results = run_steps(2, steps, tmp_path, timeout=600)
    plain, masked, resumed = (losses(results, n) for n in ("plain", "dp2", "tp2"))
    assert abs(plain[1] - masked[1]) > 1e-4, (plain, masked)  # same weights, other attention
    assert sorted(resumed) == [3, 4]
    assert max(abs(masked[i] - resumed[i]) for i in resumed) <= 1e-4, (masked, resumed)


def test_stored_arguments_rebuild_the_same_vocabulary(corpus):
    """Converters rebuild a run from its stored arguments: the EOD is added once, not twice."""
    from megatron_ucp.convert.source_model import argv_from_args

    args = data_args(corpus)
    again = validate(build_parser().parse_args(argv_from_args(vars(args))), 1)
    assert (again.vocab_size, again.padded_vocab_size) == (args.vocab_size, args.padded_vocab_size)
    assert again.data_path == args.data_path


def test_use_checkpoint_args_keeps_the_vocabulary(corpus):
    from megatron_ucp.train.checkpointing import use_checkpoint_args

    saved = vars(data_args(corpus, "--num-layers", "2"))
    args = build_parser().parse_args(["--data-path", str(corpus / "A"), "--tokenizer-type",
                                      "NullTokenizer", "--vocab-size", "99"])
    use_checkpoint_args(args, saved)
    validate(args, 1)
    assert (args.vocab_size, args.num_layers) == (VOCAB + 1, 2)


def test_mock_validation_stream_is_disjoint_from_training():
    from megatron_ucp.train.data import MOCK_VALIDATION_OFFSET, build_datasets

    args = validate(build_parser().parse_args(BASE + ["--eval-interval", "5"]), 1)
    train, valid = build_datasets(args)
    for i in (0, 3, 17):
        assert np.array_equal(valid[i], train[MOCK_VALIDATION_OFFSET + i])
        assert not np.array_equal(valid[i], train[i])


def test_validation_line_is_megatron_lms(tmp_path, capsys, process_group):
    from megatron_ucp.train.monitor import Monitor

    log = tmp_path / "loss.jsonl"
    monitor = Monitor(argparse.Namespace(tensorboard_dir=None, loss_log=str(log)))
    monitor.validation(5, 2.0)
    monitor.validation(7, 1.5, final=True)
    out = capsys.readouterr().out
    assert " validation loss at iteration 5 | lm loss value: 2.000000E+00 | lm loss PPL: " \
           "7.389056E+00 | " in out
    assert " validation loss at iteration 7 on validation set | lm loss value: 1.500000E+00 |" in out
    assert [r["iteration"] for r in log_lines(log)] == [5, 7]
    assert log_lines(log)[0]["validation_loss"] == 2.0
