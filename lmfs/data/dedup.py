"""Deduplication: exact (documents and lines, by hash), a Bloom filter, and MinHash + LSH near-dedup.

Finding duplicates among ``D`` documents by comparing every pair costs ``D²/2`` comparisons, 5·10^11
for a million documents. Every method here is linear instead: hash each document (or line, or set
of shingles) once, and let equal hashes meet in a table.

* **Exact**: :func:`text_hashes` (64 bits of BLAKE2b per text), :func:`exact_dedup` (keep the first
  copy of every document), :func:`dedup_lines` (drop every line already seen, C4-style, or every
  copy of a repeated line).
* **Bloom filter**: :class:`BloomFilter`, set membership in ``m`` bits with ``k`` hash functions,
  sized for a chosen false-positive rate. It can say "seen" for a new item, never "new" for a
  seen one.
* **Near duplicates**: :class:`MinHasher` turns each document into ``P`` MinHash values of its word
  5-gram shingles, all documents and all permutations at once with numpy; :func:`band_keys` and
  :func:`near_duplicates` band the signatures (LSH), join colliding documents with a
  :class:`UnionFind` and keep one representative per cluster. :func:`s_curve` is the probability
  that two documents of Jaccard similarity ``s`` collide in at least one band. Candidate pairs are
  verified by the signatures' estimate or by :func:`exact_jaccards` of the texts.

>>> keep = exact_dedup(["a", "b", "a", "c", "b"])
>>> keep.tolist()
[True, True, False, True, False]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lmfs.data.ngram import fmix64, ngram_hashes, word_hashes

_U64 = np.uint64

# ---------------------------------------------------------------- exact deduplication


def text_hashes(texts: Iterable[str]) -> np.ndarray:
    """A 64-bit BLAKE2b digest of each text's UTF-8 bytes, as a ``uint64`` array.

    64 bits are plenty: among a billion distinct texts the chance that any two share a hash is
    about ``n² / 2^65`` = 3 %, among a million it is 3·10^-8.
    """
    return np.fromiter((int.from_bytes(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8)
                                       .digest(), "little") for t in texts), dtype=_U64)


def first_occurrences(hashes: np.ndarray) -> np.ndarray:
    """Boolean mask, True at the first position of every distinct value of ``hashes``."""
    keep = np.zeros(len(hashes), dtype=bool)
    keep[np.unique(hashes, return_index=True)[1]] = True
    return keep


def exact_dedup(docs: Sequence[str]) -> np.ndarray:
    """Keep mask for ``docs``: True for the first copy of each distinct text, False for later copies."""
    return first_occurrences(text_hashes(docs))


def dedup_lines(docs: Sequence[str], min_chars: int = 1, keep: str = "first") -> tuple[list[str], int]:
    """Remove repeated lines across the corpus; return ``(new_docs, lines_removed)``.

    ``keep="first"`` (C4-style) removes every line already seen earlier: the first page that had a
    line keeps it. ``keep="none"`` removes every copy of a line that occurs more than once anywhere
    (two passes): boilerplate such as a menu or footer leaves every page, the first included.
    Lines are compared after stripping surrounding whitespace; lines shorter than ``min_chars``
    (blank lines, a lone "}") are never removed. A document may end up empty.

        >>> dedup_lines(["menu\\nhello", "menu\\nbye"], keep="none")
        (['hello', 'bye'], 2)
    """
    if keep not in ("first", "none"):
        raise ValueError(f"keep must be 'first' or 'none', got {keep!r}")

    def digest(key: str) -> bytes:
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()

    repeated: set[bytes] = set()
    if keep == "none":
        seen_once: set[bytes] = set()
        for doc in docs:
            for line in doc.split("\n"):
                key = line.strip()
                if len(key) >= min_chars:
                    d = digest(key)
                    (repeated if d in seen_once else seen_once).add(d)
    seen: set[bytes] = set()
    out, removed = [], 0
    for doc in docs:
        kept = []
        for line in doc.split("\n"):
            key = line.strip()
            if len(key) < min_chars:
                kept.append(line)
                continue
            d = digest(key)
            if d in seen or d in repeated:
                removed += 1
            else:
                seen.add(d)
                kept.append(line)
        out.append("\n".join(kept))
    return out, removed


# ---------------------------------------------------------------- Bloom filter


class BloomFilter:
    """A Bloom filter over 64-bit keys, sized for ``capacity`` keys at false-positive rate ``fp_rate``.

    ``k`` hash functions set ``k`` of ``m`` bits per key; a query answers "maybe present" when all
    its ``k`` bits are set. After ``n`` keys a bit is still 0 with probability ``(1 - 1/m)^{kn} ≈
    e^{-kn/m}``, so a new key is a false positive with probability ``p ≈ (1 - e^{-kn/m})^k``. For a
    given ``m/n`` this is smallest at ``k = (m/n) ln 2``, where ``p = 2^{-k}``; solving for ``m``:

        m = -n ln p / (ln 2)²   bits,      k = (m / n) ln 2     (1 % costs 9.6 bits per key, k = 7)

    The ``k`` positions come from two hashes (Kirsch and Mitzenmacher's double hashing):
    ``h_i = h_1 + i·h_2 mod m``, as good as ``k`` independent hashes for this purpose.

    >>> bloom = BloomFilter(capacity=1000, fp_rate=0.01)
    >>> bloom.m, bloom.k
    (9586, 7)
    """

    def __init__(self, capacity: int, fp_rate: float = 0.01):
        if capacity < 1 or not 0 < fp_rate < 1:
            raise ValueError(f"need capacity >= 1 and 0 < fp_rate < 1, got {capacity}, {fp_rate}")
        self.capacity, self.fp_rate = capacity, fp_rate
        self.m = math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2)
        self.k = max(1, round(self.m / capacity * math.log(2)))
        self.bits = np.zeros((self.m + 7) // 8, dtype=np.uint8)
        self.n_added = 0

    def theoretical_fp_rate(self, n: int | None = None) -> float:
        """``(1 - e^{-kn/m})^k`` after ``n`` distinct keys (default: the keys added so far)."""
        n = self.n_added if n is None else n
        return (1 - math.exp(-self.k * n / self.m)) ** self.k

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        """``(len(keys), k)`` bit positions of each key."""
        keys = np.asarray(keys, dtype=_U64)
        h1 = fmix64(keys)
        h2 = fmix64(keys ^ _U64(0x5851F42D4C957F2D)) | _U64(1)
        with np.errstate(over="ignore"):
            return (h1[:, None] + np.arange(self.k, dtype=_U64) * h2[:, None]) % _U64(self.m)

    def add(self, keys: np.ndarray) -> None:
        """Set the bits of every key (``uint64`` array)."""
        pos = self._positions(keys).ravel()
        # ufunc.at, not bits[i] |= ...: two keys may set bits of the same byte in one call.
        np.bitwise_or.at(self.bits, (pos >> _U64(3)).astype(np.int64), (1 << (pos & _U64(7))).astype(np.uint8))
        self.n_added += len(keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Boolean array: True where a key may have been added, False where it certainly was not."""
        pos = self._positions(keys)
        bit = (self.bits[(pos >> _U64(3)).astype(np.int64)] >> (pos & _U64(7)).astype(np.uint8)) & 1
        return bit.all(axis=1)

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """Streaming dedup: mask of keys not seen before (nor earlier in ``keys``); adds them."""
        keys = np.asarray(keys, dtype=_U64)
        new = first_occurrences(keys) & ~self.contains(keys)
        self.add(keys[new])
        return new


# ---------------------------------------------------------------- MinHash


def jaccard(a: set, b: set) -> float:
    """``|A ∩ B| / |A ∪ B|``, the exact Jaccard similarity (1.0 for two empty sets)."""
    return len(a & b) / len(a | b) if a or b else 1.0


def shingle_sets(docs: Sequence[str], ngram: int = 5) -> list[set[str]]:
    """Each document's set of word ``ngram``-grams as strings (the brute-force reference).

    Same shingles as :meth:`MinHasher.shingles`: a document shorter than ``ngram`` words has one
    shingle, all its words; an empty one has none.
    """
    out = []
    for doc in docs:
        w = doc.split()
        if 0 < len(w) < ngram:
            out.append({" ".join(w)})
        else:
            out.append({" ".join(w[i:i + ngram]) for i in range(len(w) - ngram + 1)})
    return out


class MinHasher:
    """MinHash signatures of word ``ngram``-gram shingles with ``num_perm`` hash functions.

    A document is the set ``S`` of its shingles, each hashed to a 32-bit number ``x``. Hash
    function ``p`` is ``h_p(x) = (a_p·x + b_p) mod 2^32`` with random odd ``a_p``: a different
    random-looking order of all 2^32 values. The document's signature is ``min_{x∈S} h_p(x)`` for
    every ``p``. For two sets ``A`` and ``B`` the minimum over ``A ∪ B`` falls on a shared shingle
    with probability ``|A ∩ B| / |A ∪ B|``, so

        P[sig_p(A) = sig_p(B)] = J(A, B),     and the fraction of equal entries estimates J
        with standard error sqrt(J (1 - J) / P).

    The work is ``shingles × P`` multiply-adds and a running minimum. It runs as numpy ops over a
    block of documents at once: for each ``p``, one multiply and one add over all the block's
    shingles, then ``np.minimum.reduceat`` cuts the result into documents. Blocks are sized to stay
    in the CPU's cache.

    >>> mh = MinHasher(num_perm=64)
    >>> sig = mh.signatures(["a b c d e f g", "a b c d e f g", "z y x w v u t"])
    >>> sig.shape, bool((sig[0] == sig[1]).all()), float((sig[0] == sig[2]).mean())
    ((3, 64), True, 0.0)
    """

    EMPTY = np.iinfo(np.uint32).max  # the signature of a document without shingles

    def __init__(self, num_perm: int = 128, ngram: int = 5, seed: int = 1, block: int = 1 << 16):
        rng = np.random.default_rng(seed)
        self.num_perm, self.ngram, self.block = num_perm, ngram, block
        self.a = rng.integers(0, 2**32, num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        self.b = rng.integers(0, 2**32, num_perm, dtype=np.uint64).astype(np.uint32)

    def shingles(self, docs: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(x, offsets)``: the 32-bit hashes of each document's word n-grams (duplicates kept)."""
        grams, offsets = ngram_hashes(*word_hashes(docs), self.ngram)
        return (grams >> _U64(32)).astype(np.uint32), offsets

    def signatures(self, docs: Sequence[str], chunk_chars: int = 1 << 16) -> np.ndarray:
        """``(len(docs), num_perm)`` ``uint32`` MinHash signatures.

        Documents are hashed in chunks of about ``chunk_chars`` characters: the byte-level arrays
        of :func:`word_hashes` then stay in the CPU cache (one pass over a whole corpus at once
        is several times slower, bound by memory traffic).
        """
        out, xs, offs, n_shingles, start = [], [], [], 0, 0
        while start < len(docs):
            stop, size = start, 0
            while stop < len(docs) and (size < chunk_chars or stop == start):
                size += len(docs[stop])
                stop += 1
            x, offsets = self.shingles(docs[start:stop])
            xs.append(x)
            offs.append(offsets[:-1] + n_shingles)
            n_shingles += len(x)
            start = stop
            # Sign once a block's worth of shingles is collected: fewer, longer numpy calls.
            if n_shingles >= self.block or start == len(docs):
                out.append(self.sign(np.concatenate(xs), np.append(np.concatenate(offs), n_shingles)))
                xs, offs, n_shingles = [], [], 0
        return np.concatenate(out) if out else np.zeros((0, self.num_perm), np.uint32)

    def sign(self, x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Signatures of documents given as shingle hashes ``x`` cut by ``offsets`` (D+1,)."""
        n_docs = len(offsets) - 1
        sig = np.full((n_docs, self.num_perm), self.EMPTY, dtype=np.uint32)
        full = np.flatnonzero(np.diff(offsets) > 0)  # reduceat cannot express an empty segment
        a = [np.uint32(v) for v in self.a]
        b = [np.uint32(v) for v in self.b]
        start = 0
        while start < len(full):
            # The next block: documents whose shingles together fit in `block` values.
            stop = np.searchsorted(offsets[full + 1], offsets[full[start]] + self.block, side="right")
            stop = max(stop, start + 1)
            docs = full[start:stop]
            lo, hi = offsets[docs[0]], offsets[docs[-1] + 1]
            xs = x[lo:hi]
            cuts = offsets[docs] - lo
            tmp = np.empty_like(xs)
            out = np.empty((self.num_perm, len(docs)), dtype=np.uint32)
            with np.errstate(over="ignore"):
                for p in range(self.num_perm):
                    np.multiply(xs, a[p], out=tmp)
                    tmp += b[p]
                    out[p] = np.minimum.reduceat(tmp, cuts)
            sig[docs] = out.T
            start = stop
        return sig


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray | float:
    """The fraction of equal MinHash values: an unbiased estimate of the Jaccard similarity."""
    return (np.asarray(sig_a) == np.asarray(sig_b)).mean(axis=-1)


# ---------------------------------------------------------------- LSH banding


def s_curve(s, bands: int, rows: int):
    """``1 - (1 - s^r)^b``: probability that two documents of similarity ``s`` share a band.

    One band of ``r`` rows matches with probability ``s^r`` (all ``r`` MinHashes agree); the pair
    becomes a candidate if any of the ``b`` bands matches. The curve rises steeply around
    ``(1/b)^{1/r}``.
    """
    return 1 - (1 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def lsh_params(threshold: float, num_perm: int = 128, fn_weight: float = 0.5) -> tuple[int, int]:
    """``(bands, rows)`` with ``bands·rows <= num_perm`` whose S-curve best separates at ``threshold``.

    Minimises ``(1 - fn_weight)·FP + fn_weight·FN``, with FP the area under the S-curve below the
    threshold (dissimilar pairs that collide) and FN the area above it left uncovered (similar
    pairs that never meet).
    """
    s_lo = np.linspace(0, threshold, 201)
    s_hi = np.linspace(threshold, 1, 201)
    best, best_cost = None, math.inf
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp = np.trapezoid(s_curve(s_lo, bands, rows), s_lo)
            fn = np.trapezoid(1 - s_curve(s_hi, bands, rows), s_hi)
            cost = (1 - fn_weight) * fp + fn_weight * fn
            if cost < best_cost:
                best, best_cost = (bands, rows), cost
    return best


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """``(D, bands)`` ``uint64``: one hash per band of each signature (equal band, equal key).

    The ``rows`` values of a band are folded into one 64-bit number and mixed; the band's index is
    folded in too, so the same values in different bands never meet.
    """
    if bands * rows > sigs.shape[1]:
        raise ValueError(f"{bands} bands x {rows} rows need {bands * rows} MinHash values per "
                         f"document, the signatures have {sigs.shape[1]}: lower bands or rows")
    keys = np.empty((len(sigs), bands), dtype=_U64)
    with np.errstate(over="ignore"):
        for j in range(bands):
            h = np.full(len(sigs), j + 1, dtype=_U64)
            for col in range(j * rows, (j + 1) * rows):
                h = h * _U64(0x9E3779B97F4A7C15) + sigs[:, col].astype(_U64)
            keys[:, j] = fmix64(h)
    return keys


def _buckets(keys: np.ndarray):
    """For each band: ``(order, new_run)``: documents sorted by key, True where a run of equal keys begins."""
    for j in range(keys.shape[1]):
        order = np.argsort(keys[:, j], kind="stable")
        k = keys[order, j]
        yield order, np.concatenate(([True], k[1:] != k[:-1]))


def bucket_edges(keys: np.ndarray) -> np.ndarray:
    """``(E, 2)`` int64 edges linking each document to the first (lowest-index) document of every
    bucket it shares, over all bands, without repeats. Connected, they give the same clusters as
    all candidate pairs, with at most ``D·bands`` edges instead of up to ``D²``."""
    parts = []
    for order, new_run in _buckets(keys):
        run = np.cumsum(new_run) - 1                          # run index of each sorted position
        first = order[np.flatnonzero(new_run)][run]           # stable sort: lowest index first
        mask = first != order
        parts.append(np.stack([first[mask], order[mask]], axis=1))
    edges = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    return np.unique(edges, axis=0) if len(edges) else edges.astype(np.int64)


def candidate_pairs(keys: np.ndarray, max_bucket: int = 1000) -> np.ndarray:
    """``(C, 2)`` all pairs ``i < j`` that share a bucket in at least one band (for measurements).

    A bucket larger than ``max_bucket`` raises: its pairs grow quadratically; use
    :func:`bucket_edges` for clustering instead.
    """
    parts = []
    for order, new_run in _buckets(keys):
        run = np.cumsum(new_run)
        largest = np.bincount(run).max() if len(run) else 0
        if largest > max_bucket:
            raise ValueError(f"a bucket holds {largest} documents (> max_bucket={max_bucket})")
        # Sorted positions p and p + d are in the same bucket when their run ids agree.
        for d in range(1, largest):
            same = run[:-d] == run[d:]
            i, j = order[:-d][same], order[d:][same]
            parts.append(np.stack([np.minimum(i, j), np.maximum(i, j)], axis=1))
    pairs = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    return np.unique(pairs, axis=0) if len(pairs) else pairs


class UnionFind:
    """Disjoint sets over ``0..n-1`` with union by size and path halving (near-constant time per call).

    >>> uf = UnionFind(5); uf.union(0, 3); uf.union(3, 4)
    >>> uf.find(4) == uf.find(0), uf.find(1) == uf.find(0)
    (True, False)
    """

    def __init__(self, n: int):
        self.parent = list(range(n))
        self.size = [1] * n

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving: point to the grandparent as we climb
            i = parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri == rj:
            return
        if self.size[ri] < self.size[rj]:
            ri, rj = rj, ri
        self.parent[rj] = ri       # the smaller tree hangs under the larger: trees stay shallow
        self.size[ri] += self.size[rj]

    def labels(self) -> np.ndarray:
        """Each element's cluster, named by its smallest member."""
        roots = np.array([self.find(i) for i in range(len(self.parent))], dtype=np.int64)
        smallest = np.full(len(roots), len(roots), dtype=np.int64)
        np.minimum.at(smallest, roots, np.arange(len(roots)))
        return smallest[roots]


@dataclass
class NearDuplicates:
    """Result of :func:`near_duplicates`: ``labels[i]`` is the smallest index in document ``i``'s
    cluster, ``keep`` is True for that representative (and for documents without duplicates)."""

    labels: np.ndarray
    keep: np.ndarray
    bands: int
    rows: int
    edges: int        # bucket edges found by LSH
    verified: int     # of which kept after verification (estimated or exact Jaccard)

    @property
    def n_clusters(self) -> int:
        """Clusters of two or more documents."""
        sizes = np.bincount(self.labels)
        return int((sizes > 1).sum())


def exact_jaccards(docs, edges: np.ndarray, ngram: int = 5) -> np.ndarray:
    """The exact Jaccard similarity of the word ``ngram``-gram shingle sets of each pair in ``edges``.

    ``docs[i]`` gives document ``i``'s text (a list, or any object indexed by int); only the
    documents in ``edges`` are read. Shingles are :meth:`MinHasher.shingles`'s, compared by their
    64-bit hashes (two different shingles collide with probability 2^-64).
    """
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    used = np.unique(edges)
    grams, offsets = ngram_hashes(*word_hashes([docs[int(i)] for i in used]), ngram)
    sets = {int(i): set(grams[offsets[k]:offsets[k + 1]].tolist()) for k, i in enumerate(used)}
    return np.array([jaccard(sets[i], sets[j]) for i, j in edges.tolist()], dtype=np.float64)


def near_duplicates(sigs: np.ndarray, threshold: float = 0.8, bands: int | None = None,
                    rows: int | None = None, verify: bool | str = True, keys: np.ndarray | None = None,
                    docs=None, ngram: int = 5) -> NearDuplicates:
    """Cluster documents whose MinHash signatures collide in some LSH band; keep one per cluster.

    ``bands``/``rows`` default to :func:`lsh_params` for ``threshold`` weighted towards recall
    (``fn_weight=0.95``; 16 x 8 at 0.8): the verification below removes the extra candidates a
    step placed low lets through, but nothing recovers a pair that never met. ``verify``:

    * ``True`` or ``"estimate"``: an LSH edge is kept if the two signatures' estimated Jaccard is
      at least ``threshold`` minus two standard errors (drops most of the S-curve's false positives
      for ``P`` comparisons per edge; at 0.8 with 128 hashes, pairs down to about 0.72 pass);
    * ``"exact"``: an edge is kept if the exact Jaccard of the two documents' shingle sets is at
      least ``threshold``; needs ``docs`` (the texts, indexed like ``sigs``; only those on an edge
      are read) and the ``ngram`` the signatures were made with;
    * ``False``: every LSH edge is kept.

    ``keys`` may pass precomputed :func:`band_keys` (computed in worker processes). The kept
    representative of a cluster is its first document.
    """
    if verify not in (True, False, "estimate", "exact"):
        raise ValueError(f"verify must be True/'estimate', 'exact' or False, got {verify!r}")
    if verify == "exact" and docs is None:
        raise ValueError("verify='exact' needs docs, the texts the signatures were made from")
    if bands is None or rows is None:
        bands, rows = lsh_params(threshold, sigs.shape[1], fn_weight=0.95)
    keys = band_keys(sigs, bands, rows) if keys is None else keys
    edges = bucket_edges(keys)
    n_edges = len(edges)
    if verify == "exact" and len(edges):
        edges = edges[exact_jaccards(docs, edges, ngram) >= threshold]
    elif verify and len(edges):
        est = np.empty(len(edges))
        for s in range(0, len(edges), 1 << 16):  # in chunks: two (chunk, P) gathers at a time
            e = edges[s:s + (1 << 16)]
            est[s:s + len(e)] = estimate_jaccard(sigs[e[:, 0]], sigs[e[:, 1]])
        margin = 2 * math.sqrt(threshold * (1 - threshold) / sigs.shape[1])
        edges = edges[est >= threshold - margin]
    uf = UnionFind(len(sigs))
    for i, j in edges.tolist():
        uf.union(i, j)
    labels = uf.labels()
    return NearDuplicates(labels, labels == np.arange(len(labels)), bands, rows, n_edges, len(edges))


# ---------------------------------------------------------------- a corpus with planted near-duplicates


def planted_corpus(n_docs: int, words_per_doc: int = 420, copy_fraction: float = 0.3,
                   max_edit: float = 0.15, vocab_size: int = 50_000, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """Random documents, some of them edited copies of earlier ones: ``(docs, source)``.

    Words are drawn from a Zipf-like vocabulary (``w<rank>``; 420 words make about 2 KB). A share
    ``copy_fraction`` of the documents copy an earlier document (``source[i]``, else -1) and
    replace each word with probability ``q ~ U(0, max_edit)``: a word 5-gram survives with
    probability ``(1-q)^5``, so the copies' Jaccard similarities spread from about 0.3 to 1.
    """
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(vocab_size)], dtype=object)
    cdf = np.cumsum(1 / np.arange(1, vocab_size + 1))
    ids = np.searchsorted(cdf, rng.random((n_docs, words_per_doc)) * cdf[-1])
    source = np.full(n_docs, -1)
    copies = np.flatnonzero(rng.random(n_docs) < copy_fraction)
    copies = copies[copies > 0]
    source[copies] = (rng.random(len(copies)) * copies).astype(np.int64)  # an earlier document
    edit = rng.random((len(copies), words_per_doc)) < rng.uniform(0, max_edit, (len(copies), 1))
    for row, i in enumerate(copies):  # in order, so a copy of a copy copies the edited text
        ids[i] = np.where(edit[row], ids[i], ids[source[i]])
    return [" ".join(vocab[row]) for row in ids], source
