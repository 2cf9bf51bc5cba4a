"""Compare with the reference libraries: Hugging Face ``tokenizers`` and OpenAI's ``tiktoken``.

* :func:`train_hf` trains Hugging Face's byte-level BPE (the GPT-2 recipe) on a file, and
  :func:`hf_merges` reads its merges back as pairs of byte strings, comparable with
  :func:`~lmfs.tokenization.train_bpe`'s.
* :func:`tiktoken_encoding` turns an lmfs :class:`~lmfs.tokenization.Tokenizer` into a
  ``tiktoken.Encoding`` with the same merges, so both must produce the same ids;
  :func:`hf_tokenizer` into a Hugging Face fast tokenizer likewise (for models evaluated through
  Hugging Face's stack, e.g. lm-eval's ``HFLM``).

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

    return tiktoken.Encoding("lmfs", pat_str=GPT2_PATTERN, mergeable_ranks=_token_ids(tok),
                             special_tokens=dict(tok.special_ids))


def _token_ids(tok: Tokenizer) -> dict[bytes, int]:
    """Token bytes -> id for the ordinary (non-special) tokens; a byte string that training built
    twice keeps its first id, as lmfs's encoder does."""
    specials = set(tok.special_ids.values())
    ids: dict[bytes, int] = {}
    for i in sorted(tok.vocab):
        if i not in specials:
            ids.setdefault(tok.vocab[i], i)
    return ids


def hf_tokenizer(tokenizer):
    """A Hugging Face ``PreTrainedTokenizerFast`` giving the same ids as an lmfs BPE ``tokenizer``.

    Byte-level BPE with the lmfs merges in their learned order (HF applies the lowest-ranked merge
    first, which is the order they were learned), GPT-2 pre-tokenization, ``<|endoftext|>`` as a
    special token (and as BOS/EOS, the token lm-eval puts in front of an empty context).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_char = bytes_to_unicode()
    text = lambda b: "".join(to_char[x] for x in b)  # noqa: E731
    specials = dict(tokenizer.special_ids)
    vocab = {text(b): i for b, i in _token_ids(tokenizer).items()}
    vocab.update(specials)                    # at their lmfs ids; add_special_tokens below marks them special
    merges = [(text(a), text(b)) for a, b in tokenizer.merges]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    eot = next(iter(specials))
    hf.add_special_tokens(list(specials))
    out = PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=eot, eos_token=eot)
    for token, i in specials.items():
        if out.convert_tokens_to_ids(token) != i:
            raise RuntimeError(f"special token {token!r} got id {out.convert_tokens_to_ids(token)}, lmfs has {i}")
    return out
