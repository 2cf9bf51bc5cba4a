"""Train a small language model from the command line and print its losses.

    python -m lmfs.train --corpus stories --mb 1 --vocab-size 1000 --d-model 128 --layers 2 \\
        --heads 4 --steps 200 --batch-size 16 --context 128 [--device auto] [--out ckpt.pt]

The corpus is tokenized once and cached (see :func:`lmfs.train.prepare_tokens`). ``--out``
writes a checkpoint every ``--checkpoint-every`` steps (by default a tenth of the run) and at the
end, each time to a temporary file renamed over the previous one, so a run killed at any moment
leaves a complete checkpoint; ``--resume`` continues from it to the same result as a run that was
never stopped. An existing ``--out`` is never overwritten silently: without ``--resume`` (continue
it) or ``--force`` (start again over it) the command refuses. ``--resume`` also refuses when the
checkpoint was written with other settings (corpus, sizes, steps, batch, learning rate, warmup,
seed, or a tokenizer that encodes differently), and names each one that differs.

On a CPU, two runs with the same arguments are identical bit for bit with ``--threads 1``; with
several threads, reductions split across threads add up in an order that can change from run to
run, and the losses then drift apart in their last digits after a dozen or more steps.
"""

import argparse
import hashlib
from pathlib import Path

import torch

from lmfs.env import resolve_device, seed_everything
from lmfs.nn import TransformerConfig, TransformerLM, generate
from lmfs.train.data import prepare_tokens
from lmfs.train.loop import TrainConfig, train

# The settings that shape a run's result, as (flag, argparse attribute): a resumed run must have
# the same ones as the run that wrote the checkpoint, or it is not a continuation of that run.
RUN_SETTINGS = [("--corpus", "corpus"), ("--mb", "mb"), ("--vocab-size", "vocab_size"),
                ("--d-model", "d_model"), ("--layers", "layers"), ("--heads", "heads"),
                ("--steps", "steps"), ("--batch-size", "batch_size"), ("--context", "context"),
                ("--lr", "lr"), ("--warmup", "warmup"), ("--seed", "seed")]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary, merges and special tokens: equal when it encodes alike."""
    digest = hashlib.sha256()
    for i in sorted(tokenizer.vocab):
        digest.update(b"%d:" % i + tokenizer.vocab[i] + b"\0")
    for a, b in tokenizer.merges:
        digest.update(a + b"\1" + b + b"\0")
    digest.update("\0".join(tokenizer.special_tokens).encode())
    return digest.hexdigest()[:16]


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse impossible values with the flag the user typed, before any work starts."""
    problems = [f"{flag} {getattr(args, attr)} must be a positive integer"
                for flag, attr in [("--steps", "steps"), ("--batch-size", "batch_size"), ("--context", "context"),
                                   ("--d-model", "d_model"), ("--layers", "layers"), ("--heads", "heads")]
                if getattr(args, attr) < 1]
    if args.vocab_size < 257:
        problems.append(f"--vocab-size {args.vocab_size} must be at least 257 (256 byte tokens + <|endoftext|>)")
    if not args.mb > 0:
        problems.append(f"--mb {args.mb} must be a positive number of megabytes")
    if not args.lr > 0:
        problems.append(f"--lr {args.lr} must be positive")
    if args.warmup is not None and not 0 <= args.warmup <= max(args.steps, 0):
        problems.append(f"--warmup {args.warmup} must lie between 0 and --steps {args.steps}")
    for flag, attr in [("--eval-every", "eval_every"), ("--checkpoint-every", "checkpoint_every")]:
        if getattr(args, attr) is not None and getattr(args, attr) < 0:
            problems.append(f"{flag} {getattr(args, attr)} must be >= 0")
    if args.d_model >= 1 and args.heads >= 1 and args.d_model % args.heads:
        problems.append(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads {args.threads} must be a positive integer")
    if problems:
        parser.error("; ".join(problems))


def _check_corpus(parser: argparse.ArgumentParser, corpus: str) -> None:
    from lmfs.data.corpora import CORPORA

    if corpus not in CORPORA and not Path(corpus).expanduser().is_file():
        parser.error(f"--corpus {corpus!r} is neither one of {', '.join(CORPORA)} nor an existing text file")


def _read_settings(path: Path) -> tuple[int, dict]:
    """The step and the ``--flag`` settings of a checkpoint: those this command stores, or, in a
    checkpoint without them, the ones its training and model configs record."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    settings = ckpt.get("extra", {}).get("run")
    if settings is None:
        train_config, model_config = ckpt.get("train_config") or {}, ckpt.get("model_config") or {}
        fields = {"--steps": train_config.get("steps"), "--batch-size": train_config.get("batch_size"),
                  "--context": train_config.get("context_length"), "--lr": train_config.get("lr"),
                  "--warmup": train_config.get("warmup_steps"), "--seed": train_config.get("seed"),
                  "--d-model": model_config.get("d_model"), "--layers": model_config.get("n_layers"),
                  "--heads": model_config.get("n_heads")}
        settings = {flag: value for flag, value in fields.items() if value is not None}
    return int(ckpt.get("step", 0)), settings


def _differences(saved: dict, current: dict) -> list[str]:
    """``--flag X in the checkpoint, Y now`` for each setting both know that differs."""
    return [f"{flag} {saved[flag]!r} in the checkpoint, {value!r} now"
            for flag, value in current.items() if flag in saved and saved[flag] != value]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmfs.train", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="stories", help="stories, pydoc, stdlib or a text file")
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size in megabytes (10^6 bytes)")
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="peak learning rate (small models take large ones)")
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps / 10)")
    parser.add_argument("--eval-every", type=int, default=None, help="default: steps / 4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's own choice); 1 makes CPU runs "
                             "repeat bit for bit")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="checkpoint file, written periodically and at the end")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="with --out: save every N steps (default: steps / 10; 0: only at the end)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --out if it exists (with the settings it was written with)")
    parser.add_argument("--force", action="store_true", help="start from step 0 even if --out exists, replacing it")
    args = parser.parse_args(argv)
    if args.resume and not args.out:
        parser.error("--resume needs --out, the checkpoint to continue from")
    if args.force and not args.out:
        parser.error("--force needs --out, the checkpoint to replace")
    if args.resume and args.force:
        parser.error("--resume continues --out and --force replaces it: pass one of them")
    if args.checkpoint_every is not None and not args.out:
        parser.error("--checkpoint-every needs --out, the file to save to")
    _check_arguments(parser, args)
    _check_corpus(parser, args.corpus)
    if args.warmup is None:
        args.warmup = args.steps // 10
    if args.checkpoint_every is None:  # a killed run then loses at most a tenth of its steps
        args.checkpoint_every = max(args.steps // 10, 1)
    settings = {flag: getattr(args, attr) for flag, attr in RUN_SETTINGS}

    out = Path(args.out) if args.out else None
    saved = None
    if out is not None and out.is_dir():
        parser.error(f"--out {out} is a folder: give a file name, e.g. {out / 'ckpt.pt'}")
    if out is not None and out.exists() and not args.force:
        try:
            step, saved = _read_settings(out)
        except Exception as err:
            parser.error(f"--out {out} exists but is not a readable checkpoint ({type(err).__name__}); "
                         "pass --force to replace it or choose another --out")
        if not args.resume:
            parser.error(f"--out {out} already holds a checkpoint (step {step}): pass --resume to continue it "
                         "or --force to start again and replace it")
        differing = _differences(saved, settings)
        if differing:
            parser.error(f"cannot --resume {out}: it was written with other settings: " + "; ".join(differing)
                         + ". Pass the checkpoint's settings, or --force to start again over it")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    device = resolve_device(args.device)
    data = prepare_tokens(args.corpus, n_bytes=int(args.mb * 1e6), vocab_size=args.vocab_size, seed=args.seed)
    settings["tokenizer"] = tokenizer_fingerprint(data.tokenizer)
    if saved is not None and saved.get("tokenizer", settings["tokenizer"]) != settings["tokenizer"]:
        parser.error(f"cannot --resume {out}: the tokenizer built now from --corpus {args.corpus!r} encodes text "
                     "differently from the one the checkpoint was trained with (did the corpus file change?). "
                     "Pass --force to start again over it, or choose another --out")
    model_config = TransformerConfig(vocab_size=data.vocab_size, context_length=args.context,
                                     d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model = TransformerLM(model_config).to(device)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, context_length=args.context, lr=args.lr,
        warmup_steps=args.warmup,
        eval_every=max(args.steps // 4, 1) if args.eval_every is None else args.eval_every,
        compile=args.compile, seed=args.seed, checkpoint_path=args.out,
        checkpoint_every=args.checkpoint_every,
    )
    history = train(model, data.train, config, val_data=data.val, resume=args.resume,
                    checkpoint_extra={"run": settings})
    rate = history.tokens[-1] / history.seconds[-1]
    print(f"final: train loss {history.loss[-1]:.4f}, val loss {history.val_loss[-1]:.4f}, "
          f"{history.seconds[-1]:.1f} s, {rate:,.0f} tokens/s")

    prompt = torch.tensor([data.tokenizer.encode("Once upon a time")], device=device)
    sample = generate(model, prompt, 40, temperature=0.8, top_k=50,
                      generator=torch.Generator(device).manual_seed(args.seed))
    print("sample:", data.tokenizer.decode(sample[0].tolist()))
    if args.out:
        print(f"checkpoint: {args.out}")


if __name__ == "__main__":
    main()
