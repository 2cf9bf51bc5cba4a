"""Encoding and decoding with a trained byte-level BPE vocabulary.

Encoding replays the training merges inside each pre-token, lowest rank (earliest learned) first:

    " lower"  ->  bytes  [" ", "l", "o", "w", "e", "r"]
              ->  merge (" ", "l")   [" l", "o", "w", "e", "r"]
              ->  merge (" l", "o")  [" lo", "w", "e", "r"]
              ->  ...  until no adjacent pair is a known merge

Decoding concatenates the tokens' bytes and decodes them as UTF-8. Because the vocabulary starts
with all 256 bytes, every string can be encoded, and every list of ids decodes to *something*
(a token sequence may end in the middle of a character; those bytes become U+FFFD).

>>> vocab = {i: bytes([i]) for i in range(256)} | {256: b" l", 257: b" lo", 258: b" low"}
>>> tok = Tokenizer(vocab, [(b" ", b"l"), (b" l", b"o"), (b" lo", b"w")])
>>> tok.encode(" lower")
[258, 101, 114]
>>> tok.decode([258, 101, 114])
' lower'

Files (:meth:`Tokenizer.save`, :meth:`Tokenizer.load`) store every token as the hex digits of its
bytes, which round-trips any byte string (spaces, newlines, invalid UTF-8) in plain text:

- ``vocab.json``: ``{"<id>": "<hex>"}``, e.g. ``{"32": "20", "256": "206c"}``;
- ``merges.txt``: a ``#`` header line, then one merge per line, ``<hex> <hex>`` in rank order;
- ``special_tokens.json``: the list of special tokens (strings).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path

from lmfs.tokenization.pretokenization import find_pretokens, special_token_regex
from lmfs.tokenization.train import merge_word

MERGES_HEADER = "#lmfs-bpe merges: one merge per line, the two tokens as hex bytes, in rank order"


def _check_str(text) -> None:
    """Refuse bytes (and anything else that is not a str) with a message that names the fix."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raise TypeError("Tokenizer.encode takes text (str), got bytes: decode them first, e.g. "
                        "data.decode('utf-8', errors='replace'), or open files in text mode")
    if not isinstance(text, str):
        raise TypeError(f"Tokenizer.encode takes text (str), got {type(text).__name__}")


class _PretokenCache(dict):
    """pre-token string -> token ids; a missing entry is computed by BPE on first use."""

    def __init__(self, bpe):
        super().__init__()
        self.bpe = bpe

    def __missing__(self, piece: str) -> list[int]:
        ids = self[piece] = self.bpe(piece)
        return ids


class Tokenizer:
    """A byte-level BPE tokenizer: ``encode`` text to ids and ``decode`` ids back to text.

    ``vocab`` maps id -> bytes and must contain all 256 single bytes; ``merges`` lists the merged
    pairs in the order they were learned (their rank). ``special_tokens`` are matched in the text
    before anything else (the longest one wins where they overlap) and always become one id each;
    those missing from ``vocab`` are added with new ids.
    """

    # Pre-token cache entries kept before the cache is emptied: bounds memory on endless input.
    max_cache_size = 500_000

    def __init__(self, vocab: dict[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Sequence[str] | None = None):
        self.vocab: dict[int, bytes] = {int(i): bytes(b) for i, b in vocab.items()}
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_tokens: list[str] = list(dict.fromkeys(special_tokens or ()))
        if "" in self.special_tokens:
            raise ValueError("a special token cannot be the empty string")

        # bytes -> id. If two ids share the same bytes (BPE can build the same string twice, from
        # different pairs), the first one is used for encoding; both decode the same.
        self.token_to_id: dict[bytes, int] = {}
        for i in sorted(self.vocab):
            self.token_to_id.setdefault(self.vocab[i], i)
        missing = [b for b in range(256) if bytes([b]) not in self.token_to_id]
        if missing:
            raise ValueError(f"the vocabulary must contain all 256 single bytes; missing: {missing[:10]}")

        # Special tokens: reuse their id when the vocabulary has them, else append a new id.
        self.special_ids: dict[str, int] = {}
        for token in self.special_tokens:
            data = token.encode("utf-8")
            if data not in self.token_to_id:
                new_id = max(self.vocab) + 1
                self.vocab[new_id] = data
                self.token_to_id[data] = new_id
            self.special_ids[token] = self.token_to_id[data]
        self._special_re = special_token_regex(self.special_tokens)
        self._max_special_len = max((len(t) for t in self.special_tokens), default=0)

        # The merges as ids: (id_a, id_b) -> rank, and (id_a, id_b) -> id of the merged token.
        self._byte_ids = [self.token_to_id[bytes([b])] for b in range(256)]
        self._ranks: dict[tuple[int, int], int] = {}
        self._merged: dict[tuple[int, int], int] = {}
        for rank, (a, b) in enumerate(self.merges):
            try:
                pair = (self.token_to_id[a], self.token_to_id[b])
                merged = self.token_to_id[a + b]
            except KeyError as err:
                raise ValueError(f"merge {rank} ({a!r}, {b!r}) uses a token that is not in the "
                                 f"vocabulary: {err.args[0]!r}") from None
            self._ranks.setdefault(pair, rank)
            self._merged.setdefault(pair, merged)
        self._cache = _PretokenCache(self.encode_pretoken)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens})")

    # ------------------------------------------------------------------------------------------
    # Encoding

    def encode_pretoken(self, piece: str) -> list[int]:
        """BPE inside one pre-token: apply the lowest-ranked merge present, until none applies.

        >>> vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"abc"}
        >>> Tokenizer(vocab, [(b"a", b"b"), (b"ab", b"c")]).encode_pretoken("abcab")
        [257, 256]
        """
        ids = [self._byte_ids[b] for b in piece.encode("utf-8")]
        ranks = self._ranks
        while len(ids) > 1:
            # The adjacent pair with the lowest rank; unknown pairs rank "infinitely" late.
            pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, len(ranks)))
            if pair not in ranks:
                break  # no adjacent pair is a merge: this pre-token is done
            # Merge every occurrence at once: a pair made by this merge can only have a later rank
            # (it contains the new token), so doing them one by one would give the same result.
            ids = merge_word(ids, pair, self._merged[pair])
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        """Ids of a list of pre-tokens, each looked up in (or added to) the cache."""
        cache = self._cache
        if len(cache) > self.max_cache_size:
            cache.clear()
        # map + chain keep the per-piece loop in C; the cache computes missing pieces itself.
        return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    def encode(self, text: str) -> list[int]:
        """Encode ``text`` to token ids.

        >>> tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
        >>> tok.encode("hi<|endoftext|>")
        [104, 105, 256]
        """
        _check_str(text)
        if self._special_re is None:
            return self._encode_pieces(find_pretokens(text))
        ids: list[int] = []
        # Even positions: ordinary text; odd positions: a special token, which is one id.
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                ids.append(self.special_ids[part])
            elif part:
                ids += self._encode_pieces(find_pretokens(part))
        return ids

    def encode_iterable(self, iterable: Iterable[str], *, buffer_chars: int = 1 << 16) -> Iterator[int]:
        """Lazily encode a stream of strings, e.g. an open file (read line by line).

        The ids are exactly those of ``encode("".join(iterable))``, but memory stays bounded by
        about ``buffer_chars`` characters (plus the longest line): text is collected until the
        buffer is full, then only the part that no later text can change is encoded (see
        :meth:`_encode_settled`), and the rest is kept for the next round.
        """
        parts: list[str] = []
        size = 0
        for chunk in iterable:
            _check_str(chunk)
            parts.append(chunk)
            size += len(chunk)
            if size >= buffer_chars:
                ids, rest = self._encode_settled("".join(parts))
                yield from ids
                parts, size = [rest], len(rest)
        yield from self.encode("".join(parts))

    def _encode_settled(self, text: str) -> tuple[list[int], str]:
        """Encode the longest prefix of ``text`` whose ids cannot depend on text that follows.

        Returns ``(ids of that prefix, the rest)``. Two things can still change at the end:

        - a special token: whether one matches at a position is only known once the longest
          special token fits after it, so matches that start in the last ``max_len - 1``
          characters wait;
        - pre-tokens: the last pre-token may grow (" wor" + "ld"), and the one before it may too
          (a "'" followed by "l" becomes "'ll" when another "l" comes). Any earlier pre-token
          ends at least two characters before the end, and the pattern never looks further
          ahead than that (the longest look-ahead is the "'ll" / "'ve" / "'re" contraction), so
          everything except the last two pre-tokens is settled.
        """
        ids: list[int] = []
        start = 0  # where the ordinary text after the last settled special token begins
        limit = len(text) - (self._max_special_len - 1) if self._special_re is not None else len(text)
        if self._special_re is not None:
            for match in self._special_re.finditer(text):
                if match.start() >= limit:
                    break  # a longer special token might still match here
                ids += self._encode_pieces(find_pretokens(text[start : match.start()]))
                ids.append(self.special_ids[match.group()])
                start = match.end()
        pieces = find_pretokens(text[start:max(start, limit)])
        if len(pieces) <= 2:
            return ids, text[start:]
        held = len(pieces[-1]) + len(pieces[-2])
        ids += self._encode_pieces(pieces[:-2])
        return ids, text[max(start, limit) - held:]

    # ------------------------------------------------------------------------------------------
    # Decoding

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The concatenated bytes of the tokens (may end in the middle of a character)."""
        try:
            return b"".join(map(self.vocab.__getitem__, ids))
        except KeyError as err:
            raise ValueError(f"unknown token id {err.args[0]!r}: this tokenizer has {len(self.vocab)} "
                             f"tokens (ids {min(self.vocab)}..{max(self.vocab)})") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text. Bytes that are not valid UTF-8 become U+FFFD ("\ufffd")."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------------------------------
    # Files

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``vocab.json``, ``merges.txt`` and ``special_tokens.json`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocab = {str(i): self.vocab[i].hex() for i in sorted(self.vocab)}
        (directory / "vocab.json").write_text(json.dumps(vocab, indent=0) + "\n", encoding="utf-8")
        lines = [MERGES_HEADER] + [f"{a.hex()} {b.hex()}" for a, b in self.merges]
        (directory / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (directory / "special_tokens.json").write_text(json.dumps(self.special_tokens) + "\n",
                                                       encoding="utf-8")
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """Read a tokenizer written by :meth:`save`."""
        directory = Path(directory)
        specials_path = directory / "special_tokens.json"
        specials = json.loads(specials_path.read_text(encoding="utf-8")) if specials_path.exists() else None
        return cls.from_files(directory / "vocab.json", directory / "merges.txt", specials)

    @classmethod
    def from_files(cls, vocab_filepath: str | os.PathLike, merges_filepath: str | os.PathLike,
                   special_tokens: Sequence[str] | None = None) -> Tokenizer:
        """Build a tokenizer from a ``vocab.json`` and a ``merges.txt`` in the format above."""
        with open(vocab_filepath, encoding="utf-8") as f:
            vocab = {int(i): bytes.fromhex(h) for i, h in json.load(f).items()}
        merges = []
        with open(merges_filepath, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    a, b = line.split()
                    merges.append((bytes.fromhex(a), bytes.fromhex(b)))
        return cls(vocab, merges, special_tokens)
