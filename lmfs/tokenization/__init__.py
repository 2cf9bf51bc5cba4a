"""Byte-level BPE tokenization, as in GPT-2: train a vocabulary, then encode and decode with it.

>>> from lmfs.tokenization import Tokenizer, train_bpe
>>> vocab, merges = train_bpe("corpus.txt", 10_000, ["<|endoftext|>"])   # doctest: +SKIP
>>> tok = Tokenizer(vocab, merges, ["<|endoftext|>"])                      # doctest: +SKIP
>>> tok.decode(tok.encode("Hello world<|endoftext|>"))                     # doctest: +SKIP
'Hello world<|endoftext|>'

Modules: :mod:`~lmfs.tokenization.pretokenization` (cutting text into pre-tokens, in parallel over a
file), :mod:`~lmfs.tokenization.train` (learning the merges),
:mod:`~lmfs.tokenization.tokenizer` (the :class:`Tokenizer`) and :mod:`~lmfs.tokenization.hf`
(the same tokenizer in Hugging Face ``tokenizers`` and ``tiktoken``, for comparison).
"""

from lmfs.tokenization.pretokenization import (GPT2_PATTERN, PRETOKEN_RE, count_pretokens,
                                           count_pretokens_in_file, find_chunk_boundaries,
                                           find_pretokens, pretokenize, split_on_special_tokens)
from lmfs.tokenization.tokenizer import Tokenizer
from lmfs.tokenization.train import PairIndex, count_pairs, learn_merges, merge_word, train_bpe

__all__ = [
    "GPT2_PATTERN", "PRETOKEN_RE", "PairIndex", "Tokenizer", "count_pairs", "count_pretokens",
    "count_pretokens_in_file", "find_chunk_boundaries", "find_pretokens", "learn_merges",
    "merge_word", "pretokenize", "split_on_special_tokens", "train_bpe",
]
