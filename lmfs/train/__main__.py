"""Train a small language model from the command line and print its losses.

    python -m lmfs.train --corpus stories --mb 1 --vocab-size 1000 --d-model 128 --layers 2 \\
        --heads 4 --steps 200 --batch-size 16 --context 128 [--device auto] [--out ckpt.pt]

The corpus is tokenized once and cached (see :func:`lmfs.train.prepare_tokens`). ``--out``
writes a checkpoint every ``--checkpoint-every`` steps (by default a tenth of the run) and at the
end, each time to a temporary file renamed over the previous one, so a run killed at any moment
leaves a complete checkpoint; ``--resume`` continues from it to the same result as a run that was
never stopped.
"""

import argparse

import torch

from lmfs.env import resolve_device, seed_everything
from lmfs.nn import TransformerConfig, TransformerLM, generate
from lmfs.train.data import prepare_tokens
from lmfs.train.loop import TrainConfig, train


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
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="checkpoint file, written periodically and at the end")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="with --out: save every N steps (default: steps / 10; 0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from --out if it exists")
    args = parser.parse_args(argv)
    if args.resume and not args.out:
        parser.error("--resume needs --out, the checkpoint to continue from")
    if args.checkpoint_every is not None and not args.out:
        parser.error("--checkpoint-every needs --out, the file to save to")
    if args.checkpoint_every is None:  # a killed run then loses at most a tenth of its steps
        args.checkpoint_every = max(args.steps // 10, 1)

    seed_everything(args.seed)
    device = resolve_device(args.device)
    data = prepare_tokens(args.corpus, n_bytes=int(args.mb * 1e6), vocab_size=args.vocab_size, seed=args.seed)
    model_config = TransformerConfig(vocab_size=data.vocab_size, context_length=args.context,
                                     d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model = TransformerLM(model_config).to(device)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, context_length=args.context, lr=args.lr,
        warmup_steps=args.steps // 10 if args.warmup is None else args.warmup,
        eval_every=max(args.steps // 4, 1) if args.eval_every is None else args.eval_every,
        compile=args.compile, seed=args.seed, checkpoint_path=args.out,
        checkpoint_every=args.checkpoint_every,
    )
    history = train(model, data.train, config, val_data=data.val, resume=args.resume)
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
