import dataclasses
import math
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import lmfs.train.loop as loop
from lmfs.nn import TransformerConfig, TransformerLM, count_params
from lmfs.train import (TrainConfig, ablate, accumulate_gradients, activation_checkpointing,
                        check_trained, compare_runs, estimate_loss, get_batch, load_checkpoint, unigram_loss,
                        make_optimizer, plot_runs, prepare_tokens, restore_rng_state, results_table,
                        rng_state, save_checkpoint, smooth, tokenize_to_memmap, train)
from lmfs.train.__main__ import main as cli


def tiny(**overrides) -> TransformerConfig:
    base = dict(vocab_size=32, context_length=16, d_model=32, n_layers=2, n_heads=4)
    return TransformerConfig(**{**base, **overrides})


def model_of(config, seed=0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(config)


def random_tokens(n=4000, vocab=32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------- data


def test_get_batch_shapes_shift_and_bounds(tmp_path):
    data = np.arange(12, dtype=np.uint16)
    data.tofile(tmp_path / "ids.bin")
    for source in (data, np.memmap(tmp_path / "ids.bin", dtype=np.uint16, mode="r")):
        x, y = get_batch(source, 500, 5, "cpu", generator=torch.Generator().manual_seed(0))
        assert x.shape == y.shape == (500, 5) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # consecutive ids: the target is the next token
        assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # each row is one contiguous window
        # every start 0..6 is drawn, so the last window ends exactly at the last token
        assert set(x[:, 0].tolist()) == set(range(12 - 5))
        assert y.max().item() == 11
    with pytest.raises(ValueError, match="context_length \\+ 1 = 13"):
        get_batch(data, 2, 12, "cpu")
    with pytest.raises(ValueError, match="1-D"):
        get_batch(data.reshape(3, 4), 2, 2, "cpu")


def test_get_batch_is_reproducible_with_a_generator():
    data = random_tokens()
    a = get_batch(data, 4, 8, "cpu", torch.Generator().manual_seed(3))
    b = get_batch(data, 4, 8, "cpu", torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


class ByteTokenizer:
    """Stands in for lmfs.tokenization.Tokenizer: one id per UTF-8 byte."""

    def __init__(self, vocab_size=256):
        self.vocab_size = vocab_size

    def encode(self, text):
        return list(text.encode())

    def encode_iterable(self, lines):
        for line in lines:
            yield from line.encode()


def test_tokenize_to_memmap_text_and_file(tmp_path):
    text = "hello world\nsecond line\n" * 50
    (tmp_path / "in.txt").write_text(text)
    from_text = tokenize_to_memmap(ByteTokenizer(), text, tmp_path / "a.bin")
    from_file = tokenize_to_memmap(ByteTokenizer(), tmp_path / "in.txt", tmp_path / "b.bin")
    assert from_text.dtype == np.uint16 and isinstance(from_file, np.memmap)
    np.testing.assert_array_equal(from_text, list(text.encode()))
    np.testing.assert_array_equal(from_file, from_text)
    assert not list(tmp_path.glob("*.tmp*"))
    big = tokenize_to_memmap(ByteTokenizer(70_000), "abc", tmp_path / "c.bin")
    assert big.dtype == np.uint32  # ids above 65,535 do not fit in uint16
    with pytest.raises(ValueError, match="no tokens"):
        tokenize_to_memmap(ByteTokenizer(), "", tmp_path / "d.bin")


def test_split_at_document_keeps_the_share_asked_for():
    from lmfs.data.corpora import EOT
    from lmfs.train.data import _split_at_document

    # Many short documents: the cut lands on the boundary nearest to 90% (by hand: after doc 9 of 10).
    docs = [f"story {i} " + "x" * 90 for i in range(10)]
    text = EOT.join(docs)
    train, val = _split_at_document(text, 0.1)
    assert train + val == text and train.endswith(EOT) and val == docs[-1]
    # A long final document (as the stdlib corpus ends with a 229 KB file): the boundary before it
    # would make 80% validation, so the cut goes to the line break nearest to 90%.
    text = "a\n" * 50 + EOT + "b\n" * 200
    train, val = _split_at_document(text, 0.1)
    assert train + val == text and train.endswith("\n")
    assert abs(len(val) / len(text) - 0.1) < 0.01
    # No boundary nor line break at all: the cut stays at 90%; both parts are non-empty.
    train, val = _split_at_document("z" * 1000, 0.1)
    assert (len(train), len(val)) == (900, 100)
    assert all(_split_at_document("ab", f) == ("a", "b") for f in (0.01, 0.5, 0.99))


def test_prepare_tokens_trains_encodes_and_caches(tmp_path, monkeypatch):
    data = prepare_tokens("stories", n_bytes=40_000, vocab_size=300, workdir=tmp_path)
    assert data.vocab_size == data.tokenizer.vocab_size <= 300
    assert len(data.train) > 5 * len(data.val) > 0
    assert data.train.max() < data.vocab_size
    assert data.tokenizer.decode(data.val[:200].tolist()).strip()  # real text comes back

    import lmfs.tokenization

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokens should have been reused")

    monkeypatch.setattr(lmfs.tokenization, "train_bpe", no_training)
    again = prepare_tokens("stories", n_bytes=40_000, vocab_size=300, workdir=tmp_path)
    np.testing.assert_array_equal(again.train, data.train)
    np.testing.assert_array_equal(again.val, data.val)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1  # no staging folder left behind
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_tokens("stories", n_bytes=40_000, vocab_size=300, workdir=tmp_path, val_fraction=0)


# ---------------------------------------------------------------- config and schedule


def test_train_config_validation_and_schedules():
    with pytest.raises(ValueError, match="divisible by grad_accum") as err:
        TrainConfig(steps=0, batch_size=6, context_length=8, grad_accum=4, schedule="linear")
    assert "steps=0" in str(err.value) and "schedule='linear'" in str(err.value)

    cfg = TrainConfig(steps=100, batch_size=4, context_length=8, lr=1e-3, warmup_steps=10)
    assert cfg.final_lr == pytest.approx(1e-4)
    assert cfg.lr_at(0) == pytest.approx(1e-4)  # the first update already moves: lr / warmup
    assert cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(99) == pytest.approx(1e-4)  # the last update lands on final_lr
    wsd = dataclasses.replace(cfg, schedule="wsd", decay_fraction=0.2, min_lr=0.0)
    assert wsd.lr_at(50) == pytest.approx(1e-3) and wsd.lr_at(79) == pytest.approx(1e-3)
    assert wsd.lr_at(89) == pytest.approx(5e-4) and wsd.lr_at(99) == 0.0
    const = dataclasses.replace(cfg, schedule="constant")
    assert const.lr_at(4) == pytest.approx(5e-4) and const.lr_at(99) == pytest.approx(1e-3)


def test_make_optimizer_decays_matrices_only():
    model = model_of(tiny(bias=True, norm="layer"))
    opt = make_optimizer(model, TrainConfig(steps=1, batch_size=1, context_length=8, weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


# ---------------------------------------------------------------- the step's pieces


def test_gradient_accumulation_equals_the_full_batch():
    model = model_of(tiny())
    x, y = get_batch(random_tokens(), 8, 16, "cpu", torch.Generator().manual_seed(0))
    full_loss = accumulate_gradients(model, [(x, y)])
    full = grads(model)
    model.zero_grad(set_to_none=True)
    half_loss = accumulate_gradients(model, zip(x.chunk(2), y.chunk(2)))
    torch.testing.assert_close(half_loss, full_loss, atol=1e-6, rtol=0)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, full[name], atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_gives_the_same_gradients():
    model = model_of(tiny())
    x, y = get_batch(random_tokens(), 4, 16, "cpu", torch.Generator().manual_seed(0))
    accumulate_gradients(model, [(x, y)])
    plain = grads(model)
    model.zero_grad(set_to_none=True)
    with activation_checkpointing(model):
        assert all("forward" in vars(block) for block in model.blocks)
        accumulate_gradients(model, [(x, y)])
        with pytest.raises(RuntimeError, match="already checkpointed"):
            with activation_checkpointing(model):
                pass
    assert not any("forward" in vars(block) for block in model.blocks)  # restored
    for name, g in grads(model).items():
        torch.testing.assert_close(g, plain[name], atol=1e-6, rtol=0, msg=name)
    with pytest.raises(ValueError, match="model.blocks"):
        with activation_checkpointing(torch.nn.Linear(2, 2)):
            pass


def test_estimate_loss_is_repeatable_and_restores_mode():
    model = model_of(tiny())
    data = random_tokens()
    a = estimate_loss(model, data, 3, 4, 16, "cpu")
    assert model.training
    assert a == estimate_loss(model, data, 3, 4, 16, "cpu")
    assert a != estimate_loss(model, data, 3, 4, 16, "cpu", seed=1)
    assert abs(a - np.log(32)) < 0.5  # an untrained model is near uniform over the vocabulary


# ---------------------------------------------------------------- train


def test_loss_decreases_on_a_repeated_pattern():
    data = np.tile(np.arange(12, dtype=np.uint16), 300)
    model = model_of(tiny(vocab_size=12, n_layers=1))
    history = train(model, data, TrainConfig(steps=30, batch_size=8, context_length=16, lr=1e-2,
                                             warmup_steps=3), val_data=data, progress=False)
    assert history.step == list(range(1, 31)) and history.tokens[-1] == 30 * 8 * 16
    assert history.loss[-1] < 0.3 * history.loss[0]
    assert history.val_step == [30] and history.val_loss[0] < 0.3 * history.loss[0]


def test_training_is_deterministic_and_history_renders():
    data = random_tokens()
    cfg = TrainConfig(steps=4, batch_size=4, context_length=16, eval_every=2, eval_batches=2)
    a = train(model_of(tiny()), data, cfg, val_data=data, progress=False)
    b = train(model_of(tiny()), data, cfg, val_data=data, progress=False)
    assert a.loss == b.loss and a.val_loss == b.val_loss and a.val_step == [2, 4]
    frame = a.to_frame()
    assert list(frame.columns) == ["step", "loss", "lr", "tokens", "seconds", "val_loss"]
    assert frame["val_loss"].notna().tolist() == [False, True, False, True]
    import matplotlib

    matplotlib.use("Agg")
    assert a.plot().get_ylabel() == "loss"


def test_nan_loss_names_the_step_and_the_fix():
    model = model_of(tiny())
    with torch.no_grad():
        model.tok_emb.weight[0] = float("nan")
    with pytest.raises(FloatingPointError, match="step 1 .*Lower the learning rate"):
        train(model, np.zeros(100, dtype=np.uint16), TrainConfig(steps=3, batch_size=2, context_length=8),
              progress=False)


class Preempted(Exception):
    pass


def test_resume_continues_exactly(tmp_path, monkeypatch):
    data = random_tokens()
    kwargs = dict(steps=10, batch_size=4, context_length=16, lr=3e-3, warmup_steps=2, eval_every=5,
                  eval_batches=2)
    straight_model = model_of(tiny())
    straight = train(straight_model, data, TrainConfig(**kwargs), val_data=data, progress=False)

    path = tmp_path / "run.pt"
    cfg = TrainConfig(**kwargs, checkpoint_path=str(path), checkpoint_every=5)

    def save_then_die(*args, **kwargs):  # the process is killed right after its first checkpoint
        save_checkpoint(*args, **kwargs)
        raise Preempted

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(Preempted):
        train(model_of(tiny()), data, cfg, val_data=data, progress=False)
    monkeypatch.undo()
    assert load_checkpoint(path, model_of(tiny()))["step"] == 5

    torch.manual_seed(123)  # a "new process": other weights and RNG state, new objects
    random.seed(123)
    resumed_model = model_of(tiny(), seed=7)
    resumed = train(resumed_model, data, cfg, val_data=data, progress=False, resume=True)
    assert resumed.step == straight.step
    assert resumed.loss == straight.loss and resumed.lr == straight.lr
    assert resumed.val_step == straight.val_step == [5, 10] and resumed.val_loss == straight.val_loss
    for (name, p), q in zip(resumed_model.named_parameters(), straight_model.parameters()):
        assert torch.equal(p, q), name


def test_resume_needs_a_path():
    with pytest.raises(ValueError, match="checkpoint_path"):
        train(model_of(tiny()), random_tokens(), TrainConfig(steps=1, batch_size=1, context_length=8),
              progress=False, resume=True)


# ---------------------------------------------------------------- experiments


def test_smooth_is_a_trailing_mean():
    values = [4.0, 2.0, 6.0, 0.0, 8.0]
    # by hand: [4], [4, 2], [4, 2, 6], [2, 6, 0], [6, 0, 8]
    np.testing.assert_allclose(smooth(values, 3), [4, 3, 4, 8 / 3, 14 / 3])
    np.testing.assert_allclose(smooth(values, 1), values)
    np.testing.assert_allclose(smooth(values, 10), np.cumsum(values) / np.arange(1, 6))  # k > length
    assert len(smooth(np.ones(100))) == 100  # default window: a 25th of the run
    np.testing.assert_allclose(smooth(np.arange(100.0))[3:], np.arange(100.0)[3:] - 1.5)  # k = 4


def test_ablate_trains_each_variant_from_the_same_start():
    data = np.tile(np.arange(12, dtype=np.uint16), 300)
    base = tiny(vocab_size=12, n_layers=1)
    base_train = TrainConfig(steps=12, batch_size=4, context_length=16, lr=1e-2, warmup_steps=2,
                             eval_every=6, eval_batches=2)
    runs = ablate(base, base_train, {"base": {}, "relu, lower lr": dict(ffn="relu", lr=3e-3)}, data,
                  val_data=data, seed=5, verbose=False)
    assert list(runs) == ["base", "relu, lower lr"]
    plain, relu = runs["base"], runs["relu, lower lr"]
    assert relu.model_config == dataclasses.replace(base, ffn="relu") and relu.train_config.lr == 3e-3
    assert relu.changes == dict(ffn="relu", lr=3e-3) and plain.model_config == base
    for run in runs.values():
        assert run.history.step == list(range(1, 13)) and run.history.val_step == [6, 12]
        assert run.params == sum(p.numel() for p in run.model.parameters()) == count_params(run.model_config)

    # the base variant is exactly a plain train() from the same seed
    torch.manual_seed(5)
    reference = train(TransformerLM(base), data, base_train, val_data=data, progress=False)
    assert plain.history.loss == reference.loss and plain.history.val_loss == reference.val_loss
    assert relu.history.loss != plain.history.loss

    both = ablate(base, base_train, {"short context": dict(context_length=8, steps=2)}, data, verbose=False)
    run = both["short context"]  # a field of both configs changes both
    assert run.model_config.context_length == run.train_config.context_length == 8
    with pytest.raises(ValueError, match="'n_layer'.*model fields"):
        ablate(base, base_train, {"typo": dict(n_layer=3)}, data)

    table = results_table(runs, last=3)
    assert list(table.index) == ["base", "relu, lower lr"]
    assert table.loc["relu, lower lr", "change"] == "ffn=relu, lr=0.003" and table.loc["base", "change"] == "—"
    assert table.loc["base", "final_train_loss"] == pytest.approx(np.mean(plain.history.loss[-3:]))
    assert table.loc["base", "final_val_loss"] == plain.history.val_loss[-1]

    check_trained(runs, ["base"], drop=0.5)
    with pytest.raises(AssertionError, match="did not go down by 100"):
        check_trained(runs, drop=100)
    with pytest.raises(AssertionError, match="is not below 0.000"):
        check_trained(runs, ["base"], below=0.0)

    import matplotlib

    matplotlib.use("Agg")
    ax = plot_runs(runs, title="two runs")
    assert ax.get_title() == "two runs" and len(ax.get_legend().get_texts()) == 2
    assert ax.get_ylim()[1] <= np.log(12) + 0.2 + 1e-9  # cut at a uniform guess over 12 tokens
    fig = compare_runs(runs, {"both": ["base", "relu, lower lr"], "one": ["base"], "again": ["base"]})
    assert sum(a.get_visible() for a in fig.axes) == 3 and len(fig.axes) == 4
    with pytest.raises(KeyError, match="no run named"):
        plot_runs(runs, ["missing"])


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_roundtrip_and_rng_state(tmp_path):
    model = model_of(tiny())
    opt = make_optimizer(model, TrainConfig(steps=1, batch_size=1, context_length=8))
    accumulate_gradients(model, [get_batch(random_tokens(), 2, 8, "cpu")])
    opt.step()
    cfg = TrainConfig(steps=3, batch_size=2, context_length=8)
    save_checkpoint(tmp_path / "a.pt", model, opt, 3, cfg, extra={"note": [1, 2]})
    draws = (random.random(), np.random.rand(), torch.rand(1).item())

    other = model_of(tiny(), seed=1)
    other_opt = make_optimizer(other, cfg)
    ckpt = load_checkpoint(tmp_path / "a.pt", other, other_opt)
    assert ckpt["step"] == 3 and ckpt["extra"] == {"note": [1, 2]}
    assert ckpt["train_config"] == dataclasses.asdict(cfg)
    assert ckpt["model_config"] == dataclasses.asdict(model.config)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    state, other_state = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(state[i]["m"], other_state[i]["m"]) for i in state)
    restore_rng_state(ckpt["rng"])  # the generators continue from the save
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_checkpoint_moves_adam_state_between_ours_and_torchs(tmp_path):
    """A checkpoint of lmfs.optim.AdamW resumes torch.optim.AdamW (the GRPO trainer steps torch's
    on a GPU) and back: the moments arrive under the other's names, the step as its type."""
    model = model_of(tiny())
    opt = make_optimizer(model, TrainConfig(steps=1, batch_size=1, context_length=8))
    accumulate_gradients(model, [get_batch(random_tokens(), 2, 8, "cpu")])
    opt.step()
    save_checkpoint(tmp_path / "ours.pt", model, opt, 1, None)
    theirs = torch.optim.AdamW([{"params": group["params"]} for group in opt.param_groups], lr=1e-3)
    load_checkpoint(tmp_path / "ours.pt", model, theirs)
    state = opt.state_dict()["state"]
    for i, entry in theirs.state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"], state[i]["m"]) and torch.equal(entry["exp_avg_sq"], state[i]["v"])
        assert float(entry["step"]) == state[i]["step"] == 1
    save_checkpoint(tmp_path / "theirs.pt", model, theirs, 1, None)
    ours = make_optimizer(model, TrainConfig(steps=1, batch_size=1, context_length=8))
    load_checkpoint(tmp_path / "theirs.pt", model, ours)
    assert all(torch.equal(e["m"], state[i]["m"]) and e["step"] == 1 for i, e in ours.state_dict()["state"].items())


def test_rng_state_survives_weights_only_load(tmp_path):
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    model = model_of(tiny())
    save_checkpoint(path, model, None, 1, None)

    def disk_full(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(path, model, None, 2, None)
    monkeypatch.undo()
    assert load_checkpoint(path, model)["step"] == 1
    assert not (tmp_path / "ckpt.pt.tmp").exists()


def test_corrupt_and_missing_checkpoints_raise_clearly(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = model_of(tiny())
    save_checkpoint(path, model, None, 1, None)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        load_checkpoint(path, model)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt", model)
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match="not an lmfs checkpoint"):
        load_checkpoint(tmp_path / "other.pt", model)


def test_config_mismatch_names_every_differing_field(tmp_path):
    save_checkpoint(tmp_path / "ckpt.pt", model_of(tiny()), None, 1, None)
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path / "ckpt.pt", model_of(tiny(n_layers=1, n_heads=2)))
    message = str(err.value)
    assert "n_layers: checkpoint 2 vs model 1" in message and "n_heads: checkpoint 4 vs model 2" in message
    assert "d_model" not in message
    with pytest.raises(ValueError, match="without optimizer state"):
        model = model_of(tiny())
        load_checkpoint(tmp_path / "ckpt.pt", model, make_optimizer(model, TrainConfig(1, 1, 8)))


# ---------------------------------------------------------------- command line


CLI_ARGS = ["--mb", "0.04", "--vocab-size", "300", "--d-model", "32", "--layers", "1", "--heads", "2",
            "--steps", "6", "--batch-size", "4", "--context", "32", "--device", "cpu"]


def test_command_line_trains_saves_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LMFS_CACHE", str(tmp_path / "cache"))  # the token cache goes under tmp_path
    args = CLI_ARGS + ["--out", str(tmp_path / "cli.pt")]
    cli(args)
    out = capsys.readouterr().out
    assert "val loss" in out and "sample:" in out and (tmp_path / "cli.pt").exists()
    assert list((tmp_path / "cache" / "tokens").iterdir())  # the tokens were cached there
    cli(args + ["--resume"])
    assert "resumed from" in capsys.readouterr().out


def test_command_line_checkpoint_every_needs_out():
    with pytest.raises(SystemExit):
        cli(["--checkpoint-every", "5"])


def cli_error(args, capsys) -> str:
    """The one error line ``python -m lmfs.train ARGS`` exits with (argparse's, on stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def trained_checkpoint(tmp_path, monkeypatch, capsys):
    """A 6-step run of the command line saved to tmp_path/keep.pt, its tokens cached in tmp_path."""
    monkeypatch.setenv("LMFS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "keep.pt"
    cli(CLI_ARGS + ["--out", str(path)])
    capsys.readouterr()
    return path


def test_command_line_refuses_to_overwrite_a_checkpoint(trained_checkpoint, capsys):
    path = trained_checkpoint
    before = path.read_bytes()
    message = cli_error(CLI_ARGS + ["--out", str(path)], capsys)
    assert f"--out {path} already holds a checkpoint (step 6)" in message
    assert "--resume" in message and "--force" in message
    assert path.read_bytes() == before                        # untouched
    assert "--resume continues --out and --force replaces it" in cli_error(
        CLI_ARGS + ["--out", str(path), "--resume", "--force"], capsys)

    torch.save({"step": 2}, path)                             # something else stands there: --force replaces it
    cli(CLI_ARGS + ["--out", str(path), "--force"])
    assert "resumed from" not in capsys.readouterr().out
    assert final_state(path)[0] == 6


def test_command_line_resume_refuses_other_settings_naming_them(trained_checkpoint, capsys):
    path = trained_checkpoint
    before = path.read_bytes()
    message = cli_error(CLI_ARGS + ["--out", str(path), "--resume", "--lr", "0.001", "--batch-size", "8",
                                    "--seed", "1", "--corpus", "pydoc"], capsys)
    assert message.startswith("python -m lmfs.train: error: cannot --resume")
    for changed in ("--lr 0.003 in the checkpoint, 0.001 now", "--batch-size 4 in the checkpoint, 8 now",
                    "--seed 0 in the checkpoint, 1 now", "--corpus 'stories' in the checkpoint, 'pydoc' now"):
        assert changed in message
    assert "--steps" not in message and "--mb" not in message  # only what differs
    assert path.read_bytes() == before


def test_command_line_resume_refuses_another_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LMFS_CACHE", str(tmp_path / "cache"))
    from lmfs.data.corpora import generate_stories

    corpus, path = tmp_path / "corpus.txt", tmp_path / "run.pt"
    corpus.write_text(generate_stories(40_000, seed=0))
    args = CLI_ARGS + ["--corpus", str(corpus), "--out", str(path), "--steps", "2"]
    cli(args)
    corpus.write_text(generate_stories(40_000, seed=5))       # same name, other text: other merges
    message = cli_error(args + ["--resume"], capsys)
    assert "the tokenizer built now" in message and "encodes text differently" in message


def test_command_line_threads_1_repeats_a_cpu_run_bit_for_bit(tmp_path, monkeypatch, capsys):
    """The docstrings' claim: with one torch thread two runs with the same arguments are identical
    (with several, reductions split across threads may add up in another order each run)."""
    monkeypatch.setenv("LMFS_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # --threads must override whatever the process had
        for name in ("a.pt", "b.pt"):
            cli(CLI_ARGS + ["--threads", "1", "--out", str(tmp_path / name)])
            assert torch.get_num_threads() == 1
            torch.set_num_threads(2)
    finally:
        torch.set_num_threads(threads)
    (step_a, history_a, weights_a), (step_b, history_b, weights_b) = (final_state(tmp_path / n) for n in ("a.pt", "b.pt"))
    assert history_a["loss"] == history_b["loss"] and history_a["val_loss"] == history_b["val_loss"]
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert "bit for bit with ``--threads 1``" in sys.modules[cli.__module__].__doc__
    assert "with one torch thread" in loop.train.__doc__ and "drift apart" in loop.train.__doc__


def test_command_line_errors_name_the_flags(tmp_path, capsys):
    message = cli_error(["--steps", "-5"], capsys)
    assert "--steps -5 must be a positive integer" in message and "warmup" not in message
    message = cli_error(["--corpus", str(tmp_path / "nosuch.txt")], capsys)
    assert f"--corpus '{tmp_path / 'nosuch.txt'}' is neither one of stories" in message and "CORPUS=" not in message
    message = cli_error(["--d-model", "30", "--heads", "4", "--warmup", "300", "--vocab-size", "100"], capsys)
    for flag in ("--d-model 30 must be divisible by --heads 4", "--warmup 300 must lie between 0 and --steps 200",
                 "--vocab-size 100 must be at least 257"):
        assert flag in message
    assert "--out" in cli_error(["--out", str(tmp_path)], capsys)  # a folder is no checkpoint file


def run_cli(args, tmp_path, log):
    """Start ``python -m lmfs.train`` in a new process with a single thread and its caches in tmp_path."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "LMFS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "LMFS_DEVICE": "cpu"}
    with open(tmp_path / log, "w") as out:  # the child keeps its own copy of the file descriptor
        return subprocess.Popen([sys.executable, "-m", "lmfs.train", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def final_state(path):
    ckpt = torch.load(path, weights_only=True)
    return ckpt["step"], ckpt["extra"]["history"], ckpt["model"]


@pytest.mark.slow  # three processes of a few seconds each
def test_command_line_run_killed_mid_way_resumes_to_the_same_result(tmp_path):
    steps, every = 400, 25
    args = ["--mb", "0.04", "--vocab-size", "300", "--d-model", "32", "--layers", "1", "--heads", "2",
            "--steps", str(steps), "--batch-size", "4", "--context", "32", "--device", "cpu",
            "--checkpoint-every", str(every)]
    path = tmp_path / "killed.pt"
    started = []
    try:
        started.append(run_cli(args + ["--out", str(tmp_path / "straight.pt")], tmp_path, "straight.log"))
        assert started[-1].wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()

        killed = run_cli(args + ["--out", str(path)], tmp_path, "killed.log")
        started.append(killed)
        deadline = time.monotonic() + 300
        while not path.exists() and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        killed.send_signal(signal.SIGKILL)  # no handler, no cleanup: as a preempted job dies
        assert killed.wait(timeout=60) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
        step_at_kill = final_state(path)[0]  # whatever the kill interrupted, the file is whole
        assert 0 < step_at_kill < steps and step_at_kill % every == 0

        started.append(run_cli(args + ["--out", str(path), "--resume"], tmp_path, "resumed.log"))
        assert started[-1].wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()
    finally:
        for process in started:  # a failed wait must not leave a training process behind
            if process.poll() is None:
                process.kill()
                process.wait()
    assert f"resumed from {path} at step {step_at_kill}" in (tmp_path / "resumed.log").read_text()

    step_a, history_a, weights_a = final_state(tmp_path / "straight.pt")
    step_b, history_b, weights_b = final_state(path)
    assert step_a == step_b == steps
    assert history_b["step"] == history_a["step"] == list(range(1, steps + 1))
    np.testing.assert_allclose(history_b["loss"], history_a["loss"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(history_b["val_loss"], history_a["val_loss"], rtol=0, atol=1e-6)
    for name, tensor in weights_a.items():
        torch.testing.assert_close(weights_b[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_unigram_loss_by_hand():
    # counts + 1 over 3 tokens: [2+1, 1+1, 0+1] / 6; val [0, 1] -> -(ln(1/2) + ln(1/3)) / 2
    assert abs(unigram_loss(np.array([0, 0, 1]), np.array([0, 1]), 3) - (math.log(2) + math.log(3)) / 2) < 1e-12
    with pytest.raises(ValueError, match="vocab_size"):
        unigram_loss(np.array([0, 5]), np.array([0]), 3)
