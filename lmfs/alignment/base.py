"""The course's base model and its SFT version: trained once per configuration, then cached.

No weights are downloaded, so the alignment lectures start from a model ``lmfs`` pre-trains
itself (:func:`base_model`) on a mix of

* the course's generated stories (:mod:`lmfs.data.corpora`, seed 0): English to model;
* arithmetic written out, ``"37 + 58 = 95"`` and ``"Question: What is 37 + 58?\\nAnswer: 95"``,
  a limited pool of distinct problems from the *train* split only (:mod:`lmfs.alignment.tasks`):
  a skill the model only partly generalises, which the RL lectures then sharpen;
* a small share of chat-formatted instruction examples, so the template's special tokens are not
  new to the model (as real pre-training data holds some dialogue).

The tokenizer is a byte-level BPE with the chat template's special tokens, trained on that text
*with the digits removed*: no merge ever joins digits, so every digit is its own token (as in
Llama or DeepSeek), which makes column-wise arithmetic learnable for a small model.

:func:`sft_model` fine-tunes the base model on ``load_split("instructions", "train")`` with
:func:`lmfs.alignment.sft.train_sft`. Both results are stored under ``$LMFS_CACHE/alignment``
(default: ``~/.cache/lmfs/alignment``, see :func:`lmfs.env.cache_dir`) in a folder named by a hash of everything that shapes
them (the configuration, the code's data version); a missing folder is rebuilt, and it is
written under a temporary name and renamed when complete, so notebooks running at the same time
never read half a model. Sizes come from ``lmfs.scales.lecture_config("15", scale)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from lmfs.alignment.sft import END, SPECIAL_TOKENS, format_prompt, train_sft
from lmfs.alignment.tasks import arithmetic_problems, arithmetic_response, instruction_examples, load_split
from lmfs.data.corpora import EOT, generate_stories
from lmfs.env import cache_dir, resolve_device
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.scales import lecture_config
from lmfs.tokenization import Tokenizer, train_bpe
from lmfs.train import TrainConfig, load_checkpoint, save_checkpoint, train

DATA_VERSION = 1   # bump when the generated text changes, so cached models are rebuilt


def cache_root() -> Path:
    """``lmfs.env.cache_dir("alignment")``: ``$LMFS_CACHE/alignment`` or ``~/.cache/lmfs/alignment``."""
    return cache_dir("alignment")


def _key(kind: str, config: dict) -> str:
    digest = hashlib.sha256(json.dumps([kind, DATA_VERSION, config], sort_keys=True).encode()).hexdigest()[:12]
    return f"{kind}-{digest}"


DIGIT_SHARES = ((1, 0.2), (2, 0.6), (3, 0.2))   # operand sizes of the arithmetic lines, and their shares


def pretraining_text(story_bytes: int, arithmetic_lines: int, chat_examples: int, seed: int = 0,
                     arithmetic_pool: int = 1_000, digit_shares=DIGIT_SHARES, chat_arithmetic: float = 0.0) -> str:
    """The base model's training text: stories, arithmetic and chat documents, shuffled, joined by EOT.

    Arithmetic comes eight lines to a document, operands of ``digit_shares``'s sizes in its shares
    (default 1, 2 or 3 digits, weights 1:3:1); a share ``chat_arithmetic`` of them is written as a
    chat exchange (the template, the working and the ``Answer:`` line, as SFT and RL prompt a
    model), the rest half as bare equations and half as question and answer. The lines repeat a fixed pool of
    ``arithmetic_pool`` distinct problems per size and op (60 for one digit): how many different
    sums the model sees, more than how often, decides how well it generalises to unseen ones,
    and so how much a checker-driven RL stage can still teach. Chat documents hold four examples
    each. Every problem and instruction is from the train split.
    """
    rng = random.Random(f"lmfs-alignment-pretraining:{seed}")
    docs = generate_stories(story_bytes, seed=seed).split(EOT)
    lines = []
    for digits, share in digit_shares:
        pool = [p for op in "+-" for p in arithmetic_problems(60 if digits == 1 else arithmetic_pool, digits, op,
                                                               seed=seed + 100, split="train")]
        for p in rng.choices(pool, k=round(arithmetic_lines * share)):
            m, form = p.meta, rng.random()
            lines.append(format_prompt(p.prompt) + arithmetic_response(p) + END if form < chat_arithmetic
                         else f"{m['a']} {m['op']} {m['b']} = {p.answer}" if form < (1 + chat_arithmetic) / 2
                         else f"Question: {p.prompt}\nAnswer: {p.answer}")
    rng.shuffle(lines)
    docs += ["\n".join(lines[i:i + 8]) for i in range(0, len(lines), 8)]
    chats = [format_prompt(i) + r + END for i, r in instruction_examples(chat_examples, seed=seed + 1, split="train")]
    docs += ["\n".join(chats[i:i + 4]) for i in range(0, len(chats), 4)]
    rng.shuffle(docs)
    return EOT.join(docs)


def train_tokenizer(text: str, vocab_size: int, sample_bytes: int, folder: Path) -> Tokenizer:
    """BPE with :data:`~lmfs.alignment.sft.SPECIAL_TOKENS`, learned on the first ``sample_bytes``
    of ``text`` with its digits removed (so no token holds a digit but the ten single digits)."""
    sample = re.sub(r"[0-9]", "", text[:sample_bytes])
    path = folder / "tokenizer-sample.txt"
    path.write_text(sample, encoding="utf-8")
    vocab, merges = train_bpe(path, vocab_size, list(SPECIAL_TOKENS))
    path.unlink()
    return Tokenizer(vocab, merges, list(SPECIAL_TOKENS))


def _store(folder: Path, build) -> None:
    """Run ``build(staging)`` in a fresh folder next to ``folder`` and rename it into place.

    When another process finished the same folder first, its result is kept and ours dropped.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        build(staging)
        try:
            os.rename(staging, folder)
        except OSError:
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load(folder: Path, device) -> tuple[TransformerLM, Tokenizer]:
    meta = json.loads((folder / "meta.json").read_text())
    model = TransformerLM(TransformerConfig(**meta["model_config"]))
    load_checkpoint(folder / "model.pt", model)
    return model.to(resolve_device(device)).eval(), Tokenizer.load(folder / "tokenizer")


def _config(scale: str, part: str) -> dict:
    cfg = getattr(lecture_config("15", scale), part, None)
    if not cfg:
        raise ValueError(f"lmfs.scales has no '{part}' entry for lecture 15 at scale {scale!r}")
    return dict(cfg)


def _folders(scale: str) -> dict[str, Path]:
    """The cache folders of the base and the SFT model at ``scale``: named by their whole configs."""
    base, sft = _config(scale, "base"), _config(scale, "sft")
    return {"base": cache_root() / _key("base", base), "sft": cache_root() / _key("sft", dict(base=base, sft=sft))}


def base_model(scale: str = "auto", device: str | torch.device | None = None,
               progress: bool = False) -> tuple[TransformerLM, Tokenizer]:
    """The pre-trained base model and its tokenizer at ``scale``, trained on first use and cached.

    ``device`` (default ``"auto"``) is where it is trained and returned, in eval mode. The
    configuration is ``lecture_config("15", scale).base``.
    """
    cfg, folder = _config(scale, "base"), _folders(scale)["base"]
    device = "auto" if device is None else device
    if not (folder / "meta.json").exists():
        _store(folder, lambda staging: _pretrain(staging, cfg, device, progress))
    return _load(folder, device)


def _pretrain(folder: Path, cfg: dict, device, progress: bool) -> None:
    started = time.perf_counter()
    text = pretraining_text(cfg["story_bytes"], cfg["arithmetic_lines"], cfg["chat_examples"], cfg["seed"],
                            cfg["arithmetic_pool"], cfg.get("digit_shares", DIGIT_SHARES), cfg.get("chat_arithmetic", 0.0))
    tokenizer = train_tokenizer(text, cfg["vocab_size"], cfg["tokenizer_bytes"], folder)
    data = np.array(tokenizer.encode(text), dtype=np.uint16)
    prepared = time.perf_counter() - started
    model_config = TransformerConfig(vocab_size=tokenizer.vocab_size, **cfg["model"])
    torch.manual_seed(cfg["seed"])
    model = TransformerLM(model_config)
    run = TrainConfig(steps=cfg["steps"], batch_size=cfg["batch_size"], context_length=model_config.context_length,
                      lr=cfg["lr"], warmup_steps=cfg["warmup_steps"], seed=cfg["seed"])
    history = train(model, data, run, device=device, progress=progress)
    tokenizer.save(folder / "tokenizer")
    save_checkpoint(folder / "model.pt", model, None, run.steps, run)
    meta = dict(model_config=asdict(model_config), tokens=len(data), text_bytes=len(text.encode()),
                prepare_seconds=prepared, train_seconds=history.seconds[-1], final_loss=history.loss[-1])
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"base model: {model.num_params() / 1e6:.2f} M parameters, {len(data):,} tokens of text prepared in "
          f"{prepared:.0f} s, {run.steps} steps in {history.seconds[-1]:.0f} s, loss {history.loss[-1]:.3f}")


def sft_model(scale: str = "auto", device: str | torch.device | None = None,
              progress: bool = False) -> tuple[TransformerLM, Tokenizer]:
    """The base model after SFT on ``load_split("instructions", "train")``, trained on first use
    and cached; configuration ``lecture_config("15", scale).sft``. Lectures 16 and 17 start here."""
    cfg, folder = _config(scale, "sft"), _folders(scale)["sft"]
    device = "auto" if device is None else device
    if not (folder / "meta.json").exists():
        model, tokenizer = base_model(scale, device, progress)

        def build(staging: Path) -> None:
            history = train_sft(model, load_split("instructions", "train"), tokenizer, progress=progress, **cfg)
            tokenizer.save(staging / "tokenizer")
            save_checkpoint(staging / "model.pt", model, None, cfg["steps"], cfg)
            meta = dict(model_config=asdict(model.config), train_seconds=history.seconds[-1],
                        final_loss=history.loss[-1])
            (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

        _store(folder, build)
    return _load(folder, device)


def accuracy_table(models: dict, tokenizer, problems, max_tokens: int = 48, samples: int = 4,
                   seed: int = 0) -> "pandas.DataFrame":
    """Held-out accuracy of each named model per problem kind, difficulty and op: greedy, and the
    mean over ``samples`` answers at temperature 1 (pass@1 as RL samples it); also the share of
    replies with an ``Answer:`` line. The numbers to look at when sizing the base model."""
    import pandas as pd

    from lmfs.alignment.sft import generate_responses
    from lmfs.alignment.tasks import check_answer, extract_answer

    rows = []
    for name, model in models.items():
        greedy = generate_responses(model, tokenizer, [p.prompt for p in problems], max_tokens)
        sampled = generate_responses(model, tokenizer, [p.prompt for p in problems], max_tokens, temperature=1.0,
                                     seed=seed, n=samples)
        for i, p in enumerate(problems):
            mine = sampled[i * samples:(i + 1) * samples]
            rows.append(dict(model=name, kind=p.kind, difficulty=p.difficulty, op=p.meta.get("op", ""),
                             greedy=check_answer(p, greedy[i]),
                             sampled=sum(check_answer(p, r) for r in mine) / samples,
                             answer_line=float(extract_answer(greedy[i]) is not None)))
    return pd.DataFrame(rows).groupby(["model", "kind", "difficulty", "op"]).mean().round(3)


def report(scale: str = "auto", device: str | torch.device | None = None, per_group: int = 100) -> "pandas.DataFrame":
    """Train (or load) the base and SFT models at ``scale`` and print their training times and
    :func:`accuracy_table` on up to ``per_group`` held-out problems per kind, difficulty and op."""
    started = time.perf_counter()
    base, tokenizer = base_model(scale, device, progress=True)
    sft, _ = sft_model(scale, device, progress=True)
    print(f"base and SFT models ready in {time.perf_counter() - started:.0f} s")
    for kind, folder in _folders(scale).items():
        meta = json.loads((folder / "meta.json").read_text())
        print(f"{kind}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in meta.items() if k != "model_config"))
    groups: dict[tuple, list] = {}
    for p in load_split("arithmetic", "test") + load_split("countdown", "test"):
        groups.setdefault((p.kind, p.difficulty, p.meta.get("op")), []).append(p)
    problems = [p for group in groups.values() for p in group[:per_group]]
    table = accuracy_table({"base": base, "sft": sft}, tokenizer, problems)
    print(table.to_string())
    return table
