"""The sharded pipeline: files in, files out, several processes, resumable, with a summary report.

    report = run_pipeline(["crawl-00.warc.gz", "crawl-01.warc.gz"], "out/", stages, workers=2)
    print(report)                       # per-stage seen / kept / keep rate / reasons, sizes, times

A crawl arrives as many files (Common Crawl: 90,000 WARC files of 1 GB per snapshot), and every
step but deduplication looks at one document at a time, so the work is split by file ("shard"):

1. **filter** (one process per shard, ``workers`` at a time): read the shard (WARC/WET or JSONL of
   :class:`~lmfs.data.Doc`), pass every document through ``stages`` (extraction, language id, PII,
   rules, quality filters: any :class:`~lmfs.data.Stage`), write the survivors to
   ``out/filtered/<shard>.jsonl``.
2. **sign** (per shard, in parallel): a 64-bit hash of each surviving text (exact dedup) and its
   MinHash signature and LSH band keys, to ``out/signatures/<shard>.npz`` (plain numeric arrays,
   read back with ``allow_pickle=False``: a file planted in the output folder cannot run code).
3. **dedup** (one process, all shards): the first copy of every exact duplicate is kept, then the
   near-duplicate clusters of what remains (:func:`lmfs.data.dedup.near_duplicates`, candidate
   pairs verified by estimated or exact Jaccard) keep their first document; everything is in shard
   order, so "first" is well defined.
4. **write** (per shard, in parallel): ``out/final/<shard>.jsonl``, the kept documents.

**Resumable.** Each per-shard output is written to a temporary name, renamed into place, and only
then marked finished by a small ``<output>.done.json`` beside it that records what produced it (the
input's size and date, the stage names, the dedup decision) and the SHA-256 of the output. A rerun
skips a shard whose marker matches and whose output still has that hash, and redoes the others, so
a shard half-written when the run was killed, or an output changed since, is never mistaken for a
finished one. Temporary files a killed run left (``.<name>.tmp<pid>``) are removed at the start of
the next. The report (``out/report.json``) sums every stage's :class:`~lmfs.data.StageStats` across
shards, finished-earlier shards included.

**Workers die with their parent.** Each worker process asks the kernel for SIGKILL when its parent
exits (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread polls the parent's pid), so a killed
run leaves no orphan finishing shards for nobody, nor one hanging on a lock forever. One run at a
time may write to an output folder (a lock file, ``out/.lock``, says so to a second).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import multiprocessing
import os
import re
import resource
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmfs.data import Doc, Stage, StageStats, run_stages, stats_table
from lmfs.data.dedup import MinHasher, band_keys, first_occurrences, lsh_params, near_duplicates, text_hashes

if sys.platform != "win32":
    import fcntl

# ---------------------------------------------------------------- shard files


def shard_name(path: str | os.PathLike) -> str:
    """The shard's name: its file name without ``.jsonl``, ``.warc.gz``, ``.wet.gz``, ..."""
    name = Path(path).name
    for suffix in (".gz", ".warc", ".wet", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _jsonl_docs(path: Path, stats: StageStats | None = None) -> Iterator[tuple[int, Doc]]:
    """``(byte offset of its line, doc)`` for each document of a JSONL shard (offsets of a gzipped
    file count uncompressed bytes)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    offset = 0
    with opener(path, "rb") as f:
        for raw in f:
            start, offset = offset, offset + len(raw)
            line = raw.decode("utf-8", "replace")
            if not line.strip():
                continue
            try:
                doc = Doc.from_json(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                if stats is not None:
                    stats.seen += 1
                    stats.remove("bad json line", snippet=line[:200])
                continue
            if stats is not None:
                stats.seen += 1
                stats.kept += 1
            yield start, doc


def read_docs(path: str | os.PathLike, stats: StageStats | None = None) -> Iterator[Doc]:
    """The documents of a shard: JSONL (one :meth:`Doc.to_json` per line) or WARC/WET (plain or gzip).

    A JSONL line that is not valid JSON, or has no ``url``, is skipped and counted in ``stats``
    (reason ``"bad json line"``); WARC problems are counted by :func:`lmfs.data.warc.read_warc`.
    """
    path = Path(path)
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        for _, doc in _jsonl_docs(path, stats):
            yield doc
    else:
        from lmfs.data.warc import read_warc

        yield from read_warc(path, stats=stats)  # it counts what it read and what it skipped, and why


def write_atomic(path: Path, lines: Iterable[str]) -> int:
    """Write ``lines`` (each ending with a newline) to ``path`` through a temporary file; return the count.

    The data is flushed and synced before the rename, so after a crash ``path`` is either the
    complete new file or absent (or the old one), never a prefix.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line)
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".done.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_done(path: Path, fingerprint: dict) -> dict | None:
    """The marker's content when ``path`` is finished with this ``fingerprint`` and still holds the
    bytes the marker's SHA-256 records, else ``None``."""
    marker = _marker(path)
    if not (marker.exists() and path.exists()):
        return None
    try:
        done = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):  # a marker cut short: the shard is not finished
        return None
    if not isinstance(done, dict) or done.get("fingerprint") != fingerprint:
        return None
    return done if done.get("sha256") == _sha256(path) else None


def mark_done(path: Path, fingerprint: dict, **info) -> None:
    """Write ``path``'s finished-marker (atomically, after ``path`` itself is in place), with the
    SHA-256 of ``path``."""
    write_atomic(_marker(path), [json.dumps(dict(fingerprint=fingerprint, sha256=_sha256(path), **info)) + "\n"])


_TMP = re.compile(r"^\..+\.tmp\d+(?:\.npz)?$")  # write_atomic's and _sign_shard's temporary names


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the temporary files a killed run left in ``out`` and its phase folders; return them."""
    removed = []
    for folder in (out, out / "filtered", out / "signatures", out / "final"):
        if folder.is_dir():
            for f in folder.iterdir():
                if _TMP.match(f.name) and f.is_file():
                    f.unlink()
                    removed.append(f)
    return removed


class _OutputLock:
    """An exclusive lock on ``out/.lock`` for one run: a second run into the same folder is refused
    (it would remove the first one's temporary files and interleave its outputs)."""

    def __init__(self, out: Path) -> None:
        self.path, self.file = out / ".lock", None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        if sys.platform != "win32":
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                self.file.close()
                if err.errno in (errno.EAGAIN, errno.EACCES):
                    raise RuntimeError(f"another run_pipeline is writing to {self.path.parent}; wait for it "
                                       "or choose another output folder") from None
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()  # closing releases the lock


def _stats_to_json(stats: StageStats) -> dict:
    # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
    d = {f: getattr(stats, f) for f in stats.__dataclass_fields__}
    d.update(removed=dict(stats.removed), counts=dict(stats.counts),
             examples={k: [list(e) for e in v] for k, v in stats.examples.items()})
    return d


def _stats_from_json(d: dict) -> StageStats:
    stats = StageStats(d["name"])
    for key, value in d.items():
        if key in ("removed", "counts"):
            value = Counter(value)
        elif key == "examples":
            value = {k: [tuple(e) for e in v] for k, v in value.items()}
        setattr(stats, key, value)
    return stats


def _file_fingerprint(path: Path) -> dict:
    st = path.stat()
    return dict(file=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)


# ---------------------------------------------------------------- the per-shard work (worker processes)


def _filter_shard(path: Path, out: Path, stages: Sequence[Stage], fingerprint: dict) -> list[dict]:
    """Phase 1 for one shard: read, run the stages, write survivors; returns the stats as JSON."""
    for stage in stages:  # each shard counts from zero; the report sums them
        stage.stats = StageStats(stage.name)
    read = StageStats("read")
    kept = (json.dumps(doc.to_json(), ensure_ascii=False) + "\n" for doc in run_stages(read_docs(path, read), stages))
    write_atomic(out, kept)
    stats = [_stats_to_json(read)] + [_stats_to_json(s.stats) for s in stages]
    mark_done(out, fingerprint, stats=stats)
    return stats


def _sign_shard(path: Path, out: Path, num_perm: int, ngram: int, bands: int, rows: int, seed: int,
                fingerprint: dict) -> int:
    """Phase 2 for one shard: exact hashes, MinHash signatures, band keys, urls and the byte offset
    of each document's line, as plain numeric arrays in an ``.npz``."""
    offsets, docs = [], []
    for offset, doc in _jsonl_docs(path):
        offsets.append(offset)
        docs.append(doc)
    texts = [d.text for d in docs]
    sigs = MinHasher(num_perm, ngram, seed).signatures(texts)
    urls = [d.url.encode("utf-8", "surrogatepass") for d in docs]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}.npz")
    np.savez(tmp, hashes=text_hashes(texts), sigs=sigs, keys=band_keys(sigs, bands, rows),
             url_bytes=np.frombuffer(b"".join(urls), dtype=np.uint8),
             url_ends=np.cumsum([len(u) for u in urls], dtype=np.int64),
             line_offsets=np.array(offsets, dtype=np.int64))
    os.replace(tmp, out)
    mark_done(out, fingerprint, docs=len(docs))
    return len(docs)


def load_signatures(path: Path, num_perm: int, bands: int) -> dict[str, np.ndarray]:
    """The arrays of one ``signatures/<shard>.npz``, checked: loaded without pickle (an object array
    raises ``ValueError`` instead of running code), with the names, dtypes and shapes
    :func:`_sign_shard` writes; anything else raises ``ValueError``."""
    want = dict(hashes=(np.uint64, 1), sigs=(np.uint32, 2), keys=(np.uint64, 2), url_bytes=(np.uint8, 1),
                url_ends=(np.int64, 1), line_offsets=(np.int64, 1))
    try:
        with np.load(path, allow_pickle=False) as z:
            if set(z.files) != set(want):
                raise ValueError(f"arrays {sorted(z.files)}, expected {sorted(want)}")
            arrays = {k: z[k] for k in want}
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npz ({err})") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    n = len(arrays["hashes"])
    for k, (dtype, ndim) in want.items():
        a = arrays[k]
        if a.dtype != dtype or a.ndim != ndim:
            raise ValueError(f"{path}: {k} is {a.dtype} with {a.ndim} dimensions, expected {np.dtype(dtype)}, {ndim}")
    ends = arrays["url_ends"]
    if (arrays["sigs"].shape != (n, num_perm) or arrays["keys"].shape != (n, bands) or len(ends) != n
            or len(arrays["line_offsets"]) != n):
        raise ValueError(f"{path}: array shapes do not agree with {n} documents, {num_perm} hashes, {bands} bands")
    if n and (ends[0] < 0 or ends[-1] != len(arrays["url_bytes"]) or (np.diff(ends) < 0).any()):
        raise ValueError(f"{path}: url_ends do not cut url_bytes into {n} urls")
    return arrays


def _urls(arrays: dict[str, np.ndarray]) -> list[str]:
    data, ends = arrays["url_bytes"].tobytes(), arrays["url_ends"].tolist()
    return [data[a:b].decode("utf-8", "surrogatepass") for a, b in zip([0] + ends[:-1], ends)]


class _ShardTexts:
    """Document ``i``'s text, read on demand: the JSON line at byte ``offsets[i]`` of ``paths[i]``."""

    def __init__(self, paths: list[Path], offsets: np.ndarray) -> None:
        self.paths, self.offsets = paths, offsets

    def __getitem__(self, i: int) -> str:
        with open(self.paths[i], "rb") as f:
            f.seek(int(self.offsets[i]))
            return json.loads(f.readline().decode("utf-8", "replace"))["text"]


def _write_shard(path: Path, out: Path, why: list[str | None], fingerprint: dict) -> list[dict]:
    """Phase 4 for one shard: keep the documents with ``why[i] is None``; stats of the two dedups."""
    exact, near = StageStats("exact dedup"), StageStats("near dedup")

    def kept():
        for doc, reason in zip(read_docs(path), why):
            exact.seen += 1
            if reason is not None and reason.startswith("exact"):
                exact.remove("exact duplicate", doc)
                continue
            exact.kept += 1
            near.seen += 1
            if reason is not None:
                near.remove("near duplicate", doc, snippet=f"[{reason}] " + doc.text[:200])
                continue
            near.kept += 1
            yield json.dumps(doc.to_json(), ensure_ascii=False) + "\n"

    write_atomic(out, kept())
    stats = [_stats_to_json(exact), _stats_to_json(near)]
    mark_done(out, fingerprint, stats=stats)
    return stats


# ---------------------------------------------------------------- the driver


@dataclass
class PipelineReport:
    """What a run did: stage statistics (summed over shards), sizes, times, memory, outputs."""

    stats: list[StageStats]
    shards: int
    skipped: dict[str, int]           # phase -> shards found finished and not redone
    seconds: dict[str, float]         # phase -> wall-clock seconds
    docs_in: int
    docs_out: int
    bytes_out: int
    peak_rss_mb: float                # this process and its finished workers, the largest of each
    outputs: list[str] = field(default_factory=list)
    clusters: int = 0                 # near-duplicate clusters of two or more documents

    def table(self):
        """One row per stage (pandas): seen, kept, keep rate, commonest reasons."""
        return stats_table(self.stats)

    def __str__(self) -> str:
        lines = [f"{self.shards} shards, {self.docs_in:,} documents in, {self.docs_out:,} out "
                 f"({self.docs_out / max(self.docs_in, 1):.1%}), {self.bytes_out / 1e6:.1f} MB written, "
                 f"{self.clusters:,} near-duplicate clusters, peak memory {self.peak_rss_mb:.0f} MB"]
        lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
                     + ("; shards already done: " + ", ".join(f"{k} {v}" for k, v in self.skipped.items())
                        if any(self.skipped.values()) else ""))
        lines.append(self.table().to_string())
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "stats"}
        d["stats"] = [_stats_to_json(s) for s in self.stats]
        return d


def _merge(into: dict[str, StageStats], stats: list[dict]) -> None:
    for d in stats:
        s = _stats_from_json(d)
        if s.name in into:
            into[s.name].merge(s)
        else:
            into[s.name] = s


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In a worker: be killed when the process ``parent`` exits.

    Linux delivers SIGKILL on the parent's death (``prctl(PR_SET_PDEATHSIG)``); a parent already
    gone before that call is caught by comparing ``os.getppid()``. Elsewhere a daemon thread polls
    ``os.getppid()`` twice a second and ends the process when it changes (re-parenting).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent:
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="lmfs-parent-watch", daemon=True).start()


def _run_phase(name: str, jobs: list[tuple[Callable, tuple]], workers: int, progress: bool) -> list:
    """Run ``fn(*args)`` for each job, in ``workers`` processes (inline for one); results in job order."""
    from tqdm.auto import tqdm

    results = [None] * len(jobs)
    bar = tqdm(total=len(jobs), desc=name, unit="shard", disable=not progress or not jobs)
    if workers <= 1 or len(jobs) <= 1:
        for i, (fn, args) in enumerate(jobs):
            results[i] = fn(*args)
            bar.update()
    else:
        # fork: workers start at once and inherit the stages (models) without pickling them twice.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                 initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(fn, *args): i for i, (fn, args) in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update()
    bar.close()
    return results


def run_pipeline(inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, stages: Sequence[Stage] = (),
                 *, dedup: bool = True, threshold: float = 0.8, num_perm: int = 128, ngram: int = 5,
                 bands: int | None = None, rows: int | None = None, seed: int = 1, workers: int = 2,
                 verify: str = "estimate", progress: bool = True) -> PipelineReport:
    """Run ``stages`` over every input shard, then deduplicate across shards; see the module docstring.

    ``inputs``: shard files (WARC/WET, ``.jsonl``). ``stages``: per-document stages, in order.
    ``dedup``: exact then MinHash near-dedup at Jaccard ``threshold`` (``num_perm`` permutations,
    word ``ngram`` shingles, LSH ``bands x rows``, as :func:`near_duplicates` chooses when not given);
    ``verify``: candidate pairs checked by the signatures' ``"estimate"`` of Jaccard or by the
    ``"exact"`` Jaccard of the texts (read back from the filtered shards, only those on an LSH edge).
    ``workers``: processes. Outputs are in ``out_dir/final`` (``out_dir/filtered`` without dedup).
    Without stages, JSONL inputs go straight to deduplication (no filtered copy is written).
    """
    out = Path(out_dir)
    inputs = [Path(p) for p in inputs]
    missing = [str(p) for p in inputs if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input shards not found: {missing}")
    names = [shard_name(p) for p in inputs]
    if len(set(names)) != len(names):
        raise ValueError(f"two input shards have the same name: {names}; rename one (outputs are named after them)")
    if verify not in ("estimate", "exact"):
        raise ValueError(f"verify must be 'estimate' or 'exact', got {verify!r}")
    stage_names = [s.name for s in stages]
    with _OutputLock(out):
        remove_leftovers(out)
        return _run(inputs, out, names, stages, stage_names, dedup, threshold, num_perm, ngram, bands, rows, seed,
                    workers, verify, progress)


def _run(inputs, out, names, stages, stage_names, dedup, threshold, num_perm, ngram, bands, rows, seed, workers,
         verify, progress) -> PipelineReport:
    seconds, skipped, merged = {}, {}, {}

    # Phase 1: filter.
    started = time.perf_counter()
    filtered = [out / "filtered" / f"{n}.jsonl" for n in names]
    prints = [dict(_file_fingerprint(p), stages=stage_names) for p in inputs]
    jobs, done_stats = [], []
    if not stages and dedup and all(p.name.endswith(".jsonl") for p in inputs):
        filtered = inputs  # nothing to filter: deduplicate the input shards as they are
    else:
        for p, f, fp in zip(inputs, filtered, prints):
            done = is_done(f, fp)
            if done:
                done_stats.append(done["stats"])
            else:
                jobs.append((_filter_shard, (p, f, list(stages), fp)))
        skipped["filter"] = len(inputs) - len(jobs)
        for stats in done_stats + _run_phase("filter", jobs, workers, progress):
            _merge(merged, stats)
        seconds["filter"] = time.perf_counter() - started
    finals, clusters = filtered, 0

    if dedup:
        if bands is None or rows is None:  # as near_duplicates: weighted towards recall
            bands, rows = lsh_params(threshold, num_perm, fn_weight=0.95)
        # Phase 2: sign.
        started = time.perf_counter()
        sig_paths = [out / "signatures" / f"{n}.npz" for n in names]
        sign_prints = [dict(_file_fingerprint(f), num_perm=num_perm, ngram=ngram, bands=bands, rows=rows, seed=seed)
                       for f in filtered]
        loaded: list[dict | None] = [None] * len(inputs)
        jobs = []
        for k, (f, sig, fp) in enumerate(zip(filtered, sig_paths, sign_prints)):
            if is_done(sig, fp):
                try:  # what a resume reuses is checked, not trusted
                    loaded[k] = load_signatures(sig, num_perm, bands)
                except ValueError:
                    pass
            if loaded[k] is None:
                jobs.append((_sign_shard, (f, sig, num_perm, ngram, bands, rows, seed, fp)))
        skipped["sign"] = len(inputs) - len(jobs)
        _run_phase("sign", jobs, workers, progress)
        loaded = [z if z is not None else load_signatures(sig, num_perm, bands) for z, sig in zip(loaded, sig_paths)]
        seconds["sign"] = time.perf_counter() - started

        # Phase 3: decide, over all shards at once.
        started = time.perf_counter()
        sizes = [len(z["hashes"]) for z in loaded]
        hashes = np.concatenate([z["hashes"] for z in loaded]) if loaded else np.zeros(0, np.uint64)
        urls = [u for z in loaded for u in _urls(z)]
        why: list[str | None] = [None] * len(hashes)
        first = first_occurrences(hashes)
        if len(hashes):
            _, first_index, inverse = np.unique(hashes, return_index=True, return_inverse=True)
            for i in np.flatnonzero(~first):
                why[i] = f"exact copy of {urls[first_index[inverse[i]]]}"
        alive = np.flatnonzero(first)
        sigs = np.concatenate([z["sigs"] for z in loaded])[alive]
        keys = np.concatenate([z["keys"] for z in loaded])[alive]
        texts = None
        if verify == "exact":
            offsets = np.concatenate([z["line_offsets"] for z in loaded])[alive]
            shard_of = np.searchsorted(np.cumsum(sizes), alive, side="right")
            texts = _ShardTexts([filtered[k] for k in shard_of], offsets)
        result = near_duplicates(sigs, threshold, bands, rows, keys=keys, verify=verify, docs=texts, ngram=ngram)
        for i in np.flatnonzero(~result.keep):
            why[alive[i]] = f"near copy of {urls[alive[result.labels[i]]]}"
        clusters = result.n_clusters
        del sigs, keys, loaded
        seconds["dedup"] = time.perf_counter() - started

        # Phase 4: write.
        started = time.perf_counter()
        finals = [out / "final" / f"{n}.jsonl" for n in names]
        bounds = np.cumsum([0] + sizes)
        jobs, done_stats = [], []
        for k, (f, final) in enumerate(zip(filtered, finals)):
            decision = why[bounds[k]:bounds[k + 1]]
            fp = dict(_file_fingerprint(f), decision=hashlib.sha1(json.dumps(decision).encode()).hexdigest())
            done = is_done(final, fp)
            if done:
                done_stats.append(done["stats"])
            else:
                jobs.append((_write_shard, (f, final, decision, fp)))
        skipped["write"] = len(inputs) - len(jobs)
        for stats in done_stats + _run_phase("write", jobs, workers, progress):
            _merge(merged, stats)
        seconds["write"] = time.perf_counter() - started

    order = ["read", *stage_names, "exact dedup", "near dedup"]
    stats = [merged[n] for n in order if n in merged]
    docs_out = sum(sum(1 for _ in open(f, encoding="utf-8")) for f in finals)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB on Linux
    report = PipelineReport(stats=stats, shards=len(inputs), skipped=skipped, seconds=seconds,
                            docs_in=stats[0].seen if stats else 0, docs_out=docs_out,
                            bytes_out=sum(f.stat().st_size for f in finals), peak_rss_mb=peak / 1024,
                            outputs=[str(f) for f in finals], clusters=clusters)
    write_atomic(out / "report.json", [json.dumps(report.to_json(), indent=1, default=str) + "\n"])
    return report
