"""Token data for training: tokenize a corpus once to a file, then sample batches from it.

Token ids live in a flat on-disk array (``np.memmap``), one ``uint16`` per token while the
vocabulary fits (65,536 ids), so a corpus far larger than RAM costs only the pages a batch touches.
A batch is ``batch_size`` random windows of ``context_length + 1`` consecutive tokens: ``x`` is
each window without its last token and ``y`` the same window shifted left by one, so ``y[b, t]``
is the token that follows ``x[b, :t + 1]``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmfs.data.corpora import EOT, load_corpus
from lmfs.env import cache_dir

# Ids written to disk per chunk while streaming: bounds memory whatever the corpus size.
_CHUNK_TOKENS = 1 << 20


def get_batch(data: np.ndarray, batch_size: int, context_length: int, device: torch.device | str = "cpu",
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``, each int64 ``(batch_size, context_length)`` on ``device``, from random windows.

    Window starts are uniform over every position that leaves room for the shifted target, drawn
    with ``generator`` (a CPU ``torch.Generator``; the global RNG when ``None``).

    >>> x, y = get_batch(np.arange(100), 2, 5, generator=torch.Generator().manual_seed(0))
    >>> bool((y == x + 1).all())
    True
    """
    if data.ndim != 1:
        raise ValueError(f"data must be a flat 1-D array of token ids, got shape {data.shape}")
    if len(data) < context_length + 1:
        raise ValueError(f"data holds {len(data)} tokens but one window needs context_length + 1 = "
                         f"{context_length + 1}: use more text or a shorter context_length")
    starts = torch.randint(len(data) - context_length, (batch_size,), generator=generator).numpy()
    # Fancy indexing reads just the rows we need, also from a memmap (it never loads the file).
    windows = torch.from_numpy(data[starts[:, None] + np.arange(context_length + 1)].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    device = torch.device(device)
    if device.type == "cuda":  # pinned memory lets the copy overlap with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def _token_dtype(vocab_size: int, dtype=np.uint16):
    """``dtype`` if every id below ``vocab_size`` fits in it, else ``uint32``."""
    return np.dtype(dtype) if vocab_size - 1 <= np.iinfo(dtype).max else np.dtype(np.uint32)


def tokenize_to_memmap(tokenizer, text_or_path: str | os.PathLike, out_path: str | os.PathLike,
                       dtype=np.uint16) -> np.memmap:
    """Encode a text, or a file, into a flat binary file of token ids; return it as a read-only memmap.

    A ``pathlib.Path`` (or other path object) is read from disk and streamed through
    ``tokenizer.encode_iterable``, so memory stays bounded; a ``str`` is the text itself. Ids are
    ``dtype`` (``uint16``) unless the vocabulary has more than 65,536 ids, then ``uint32``. The
    file has no header: read it back with ``np.memmap(out_path, dtype=...)``. It is written to a
    temporary name and renamed, so a reader never sees half a file.
    """
    dtype = _token_dtype(tokenizer.vocab_size, dtype)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    if isinstance(text_or_path, str):
        ids, source = iter(tokenizer.encode(text_or_path)), None
    else:
        source = open(text_or_path, encoding="utf-8")
        ids = tokenizer.encode_iterable(source)
    try:
        with open(tmp, "wb") as out:
            while True:
                chunk = np.fromiter(itertools.islice(ids, _CHUNK_TOKENS), dtype=dtype)
                if chunk.size == 0:
                    break
                chunk.tofile(out)
    finally:
        if source is not None:
            source.close()
    if tmp.stat().st_size == 0:
        tmp.unlink()
        raise ValueError(f"{text_or_path!r} encodes to no tokens: give it some text")
    os.replace(tmp, out_path)
    return np.memmap(out_path, dtype=dtype, mode="r")


@dataclass
class TokenData:
    """A tokenized corpus split into training and validation ids, and the tokenizer that made them."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: object
    vocab_size: int


def _split_at_document(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut ``text`` so about ``val_fraction`` of it is validation, at a document boundary if one is near.

    Cutting inside a story would put its beginning in one split and its end in the other, so the
    cut moves to the document boundary (just after an ``EOT``) nearest to it, when that boundary
    keeps the validation share within half of ``val_fraction`` of the share asked for. A corpus of
    a few long documents (a 229 KB source file ends the stdlib corpus) has no such boundary: moving
    the cut there would hand most of the text to validation, so the cut goes to the line break
    nearest to it instead (or stays put in a text without one). Both parts are non-empty whenever
    the text has two characters or more.
    """
    n = len(text)
    cut = min(max(int(n * (1 - val_fraction)), 1), n - 1) if n > 1 else n
    slack = n * val_fraction / 2
    boundaries = []
    after = text.find(EOT, max(cut - len(EOT) + 1, 0))  # also an EOT that the cut falls inside
    if after != -1 and after + len(EOT) < n:
        boundaries.append(after + len(EOT))
    before = text.rfind(EOT, 0, cut)
    if before != -1 and before + len(EOT) < n:
        boundaries.append(before + len(EOT))
    near = [b for b in boundaries if abs(b - cut) <= slack and 0 < b < n]
    if near:
        cut = min(near, key=lambda b: abs(b - cut))
        return text[:cut], text[cut:]
    lines = [i + 1 for i in (text.rfind("\n", 0, cut), text.find("\n", cut)) if i != -1 and 0 < i + 1 < n]
    lines = [i for i in lines if abs(i - cut) <= slack]
    if lines:
        cut = min(lines, key=lambda i: abs(i - cut))
    return text[:cut], text[cut:]


def _cache_key(corpus: str, n_bytes: int, vocab_size: int, seed: int, val_fraction: float) -> str:
    """A folder name unique to the arguments (and, for a file corpus, to the file's size and date)."""
    # "split-nearest" names the rule of _split_at_document: data cut by an older rule is not reused
    parts = [corpus, n_bytes, vocab_size, seed, val_fraction, "split-nearest"]
    path = Path(corpus).expanduser()
    if path.is_file():
        stat = path.stat()
        parts += [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    digest = hashlib.sha1(repr(parts).encode()).hexdigest()[:10]
    name = corpus if corpus.isidentifier() else path.stem
    return f"{name}-{n_bytes}B-v{vocab_size}-s{seed}-{digest}"


def prepare_tokens(corpus: str = "stories", n_bytes: int = 1_000_000, vocab_size: int = 1_000,
                   seed: int = 0, workdir: str | os.PathLike | None = None,
                   val_fraction: float = 0.1) -> TokenData:
    """Train a BPE tokenizer on a corpus and tokenize it into train/val memmaps; cached on disk.

    ``corpus`` is a name or path understood by :func:`lmfs.data.corpora.load_corpus`; the last
    ``val_fraction`` of its text (cut at a document boundary) is held out for validation, and
    the tokenizer is trained on the rest only, with ``<|endoftext|>`` as its special token.

    Results are kept in ``workdir`` (default: ``lmfs.env.cache_dir("tokens")``, that is
    ``$LMFS_CACHE/tokens`` or ``~/.cache/lmfs/tokens``) under a name made from the arguments, so every notebook and run asking for the same data
    reuses them. The folder is built under a temporary name and renamed when complete, so two
    processes preparing the same data at once never see each other's half-written files.
    """
    from lmfs.tokenization import Tokenizer, train_bpe

    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    root = Path(workdir) if workdir is not None else cache_dir("tokens")
    folder = root / _cache_key(corpus, n_bytes, vocab_size, seed, val_fraction)

    if not (folder / "meta.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
        try:
            train_text, val_text = _split_at_document(load_corpus(corpus, n_bytes, seed), val_fraction)
            (staging / "train.txt").write_text(train_text, encoding="utf-8")
            vocab, merges = train_bpe(staging / "train.txt", vocab_size, [EOT])
            tokenizer = Tokenizer(vocab, merges, [EOT])
            tokenizer.save(staging / "tokenizer")
            train = tokenize_to_memmap(tokenizer, staging / "train.txt", staging / "train.bin")
            val = tokenize_to_memmap(tokenizer, val_text, staging / "val.bin")
            meta = dict(corpus=corpus, n_bytes=n_bytes, vocab_size=tokenizer.vocab_size, seed=seed,
                        val_fraction=val_fraction, dtype=train.dtype.name,
                        train_tokens=len(train), val_tokens=len(val),
                        train_bytes=len(train_text.encode()), val_bytes=len(val_text.encode()))
            del train, val  # close the memmaps before the folder moves
            (staging / "train.txt").unlink()
            (staging / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            try:
                os.rename(staging, folder)
            except OSError:  # another process finished the same data first: use theirs
                pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    meta = json.loads((folder / "meta.json").read_text())
    tokenizer = Tokenizer.load(folder / "tokenizer")
    train = np.memmap(folder / "train.bin", dtype=meta["dtype"], mode="r")
    val = np.memmap(folder / "val.bin", dtype=meta["dtype"], mode="r")
    print(f"tokens: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val from "
          f"{(meta['train_bytes'] + meta['val_bytes']) / 1e6:.2f} MB of {corpus!r} "
          f"({meta['train_bytes'] / meta['train_tokens']:.2f} bytes/token, vocab {tokenizer.vocab_size:,}) "
          f"in {folder}")
    return TokenData(train=train, val=val, tokenizer=tokenizer, vocab_size=tokenizer.vocab_size)
