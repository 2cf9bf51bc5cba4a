"""Compare with the reference libraries: Hugging Face ``tokenizers`` and OpenAI's ``tiktoken``.

* :func:`train_hf` trains Hugging Face's byte-level BPE (the GPT-2 recipe) on a file, and
  :func:`hf_merges` reads its merges back as pairs of byte strings, comparable with
  :func:`~lmfs.tokenization.train_bpe`'s.
* :func:`tiktoken_encoding` turns an lmfs :class:`~lmfs.tokenization.Tokenizer` into a
  ``tiktoken.Encoding`` with the same merges, so both must produce the same ids.

Hugging Face stores byte-level tokens as text, one printable character per byte
(:func:`bytes_to_unicode`); tiktoken stores them as bytes, with their rank.

Both libraries are imported only when a function here is called.

>>> to_char = bytes_to_unicode()
>>> to_char[ord(" ")], to_char[ord("\\n")], to_char[ord("a")]
('Ġ', 'Ċ', 'a')
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from lmfs.tokenization.pretokenization import GPT2_PATTERN
from lmfs.tokenization.tokenizer import Tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's (and HF ByteLevel's) map from each byte to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 (control bytes, space, ...) are moved
    to U+0100 and up, in byte order: space becomes "Ġ" (U+0120), newline "Ċ" (U+010A).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def train_hf(path: str | os.PathLike, vocab_size: int, special_tokens: Sequence[str] = ()):
    """Train Hugging Face's byte-level BPE the way GPT-2 was trained; return ``(tokenizer, seconds)``.

    BPE model, ``ByteLevel(add_prefix_space=False)`` pre-tokenizer, every byte in the initial
    alphabet, no progress bar; only the ``train`` call is timed, so the time compares with the
    time of :func:`~lmfs.tokenization.train_bpe` on the same file.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    start = time.perf_counter()
    tok.train([os.fspath(path)], trainer)
    return tok, time.perf_counter() - start


def hf_merges(tok) -> list[tuple[bytes, bytes]]:
    """A trained HF ByteLevel BPE's merges as pairs of byte strings (undoing its byte->char map)."""
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    merges = []
    for m in json.loads(tok.to_str())["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m  # older versions store "a b", newer [a, b]
        merges.append((bytes(to_byte[c] for c in a), bytes(to_byte[c] for c in b)))
    return merges


def tiktoken_encoding(tok: Tokenizer):
    """A ``tiktoken.Encoding`` with the same ranks, pattern and special tokens as an lmfs Tokenizer.

    tiktoken's ranks are token bytes -> id; its BPE merges the lowest-ranked pair first, which is
    the same as applying our merges in the order they were learned, so both give the same ids.
    A byte string that training built twice keeps its first id.
    """
    import tiktoken

    specials = tok.special_ids
    ranks: dict[bytes, int] = {}
    for i in sorted(tok.vocab):
        if i not in specials.values():
            ranks.setdefault(tok.vocab[i], i)
    return tiktoken.Encoding("lmfs", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=dict(specials))
