"""Benchmark lmfs's byte-level BPE against Hugging Face ``tokenizers`` and ``tiktoken``.

    python -m lmfs.benchmarks bpe [--mb 30] [--vocab-size 10000] [--json results/cpu/bpe.json]

Two texts of ``--mb`` MiB each are written to a temporary folder: synthetic stories
(:func:`lmfs.data.corpora.write_stories`) and the CPython standard library's source
(:func:`lmfs.data.corpora.write_stdlib_source`), documents separated by ``<|endoftext|>``. Then:

1. Training wall time: :func:`lmfs.tokenization.train_bpe` against HF's ``BpeTrainer`` (BPE model,
   ``ByteLevel(add_prefix_space=False)`` pre-tokenizer, the same vocabulary size and special
   token, ``initial_alphabet=ByteLevel.alphabet()``), on the same file with the same number of
   cores (``--workers`` processes for lmfs, as many Rayon threads for HF). Every run is a fresh
   subprocess, timed inside around the training call only, best of ``--repeats``.
2. Encoding throughput of the whole text on one thread: lmfs's ``Tokenizer.encode`` (with an empty
   cache, then again with a full one) against a ``tiktoken.Encoding`` built offline from lmfs's own
   merges (``mergeable_ranks`` = token bytes -> id, GPT-2 pattern, the special token).
3. Agreement: (a) lmfs's ids equal tiktoken's on the whole text; (b) lmfs's merges against HF's,
   plus a replay of HF's input handling and tie-break with lmfs's merge loop, which shows where
   the differences come from (see :func:`hf_replay`).

The Hugging Face and tiktoken versions are built by :mod:`lmfs.tokenization.hf`, which lecture 01
uses too; :func:`learn_merges_with_ties`, the merge loop with another tie-break rule, exists only
for the replay and lives here.
4. Memory: peak resident-memory growth of ``encode_iterable`` over an open file, for the base file
   and for a file 10 times larger (written, measured, then deleted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmfs.tokenization import PairIndex
from lmfs.tokenization.hf import bytes_to_unicode, hf_merges, tiktoken_encoding, train_hf

EOT = "<|endoftext|>"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Child processes (one per measured run)


def child_train_lmfs(path: str, vocab_size: int, workers: int) -> dict:
    from lmfs.tokenization import train_bpe

    start = time.perf_counter()
    vocab, merges = train_bpe(path, vocab_size, [EOT], num_workers=workers)
    return {"seconds": time.perf_counter() - start, "vocab": vocab, "merges": merges}


def child_train_hf(path: str, vocab_size: int) -> dict:
    tok, seconds = train_hf(path, vocab_size, [EOT])
    return {"seconds": seconds, "merges": hf_merges(tok), "vocab_size": tok.get_vocab_size()}


def current_rss() -> int:
    """This process's resident memory in bytes, now (Linux: /proc; elsewhere psutil or the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def child_stream(tokdir: str, path: str) -> dict:
    """Stream a file through encode_iterable, sampling resident memory every 10 ms."""
    from lmfs.tokenization import Tokenizer

    tok = Tokenizer.load(tokdir)
    before = current_rss()
    peak, done = before, threading.Event()

    def sample():
        nonlocal peak
        while not done.wait(0.01):
            peak = max(peak, current_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    n_ids, start = 0, time.perf_counter()
    with open(path, encoding="utf-8") as f:
        for _ in tok.encode_iterable(f):
            n_ids += 1
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak = max(peak, current_rss())
    return {"seconds": seconds, "n_ids": n_ids, "rss_before": before, "rss_peak": peak,
            "bytes": os.path.getsize(path)}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_child(kind: str, workdir: Path, env_extra: dict | None = None, **kwargs) -> dict:
    """Run ``kind`` in a fresh Python process and return what it pickled."""
    out = workdir / f"child-{kind}.pkl"
    cmd = [sys.executable, "-m", "lmfs.benchmarks.bpe", "--child", kind, "--child-out", str(out),
           "--child-args", json.dumps(kwargs)]
    env = dict(os.environ, **(env_extra or {}))
    subprocess.run(cmd, check=True, env=env)
    with open(out, "rb") as f:
        result = pickle.load(f)
    out.unlink()
    return result


# ----------------------------------------------------------------------------------------------
# Comparisons


def learn_merges_with_ties(pretoken_counts: dict[str, int], vocab: dict[int, bytes], n_merges: int,
                           tie_break: Callable[[tuple[int, int]], Any]) -> list[tuple[bytes, bytes]]:
    """:func:`lmfs.tokenization.learn_merges` with another tie-break: among equally frequent
    pairs, the one with the greatest ``tie_break((id_a, id_b))`` is merged. With
    ``tie_break=lambda p: (vocab[p[0]], vocab[p[1]])`` it is ``learn_merges`` itself."""
    index = PairIndex([list(token.encode("utf-8")) for token in pretoken_counts],
                      list(pretoken_counts.values()))
    merges: list[tuple[bytes, bytes]] = []
    for _ in range(n_merges):
        top = index.most_frequent()
        if not top:
            break
        a, b = max(top, key=tie_break)
        new_id = len(vocab)
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        index.merge((a, b), new_id)
    return merges


def hf_replay(path: str, vocab_size: int, *, hf_input: bool = True, hf_ties: bool = True
              ) -> list[tuple[bytes, bytes]]:
    """lmfs's trainer fed the way HF feeds its own and/or with HF's tie-break; returns the merges.

    What HF (tokenizers 0.2x) does differently, from its source:

    - ``Tokenizer.train(files)`` reads each file line by line (``lines_with_ending``) and
      pre-tokenizes every line on its own, so no pre-token spans a newline: "\\n    " (a newline
      and the next line's indentation) never becomes one pre-token, hence never one token.
    - The training text is only normalized and pre-tokenized; special tokens are not split out,
      so "<|endoftext|>" is ordinary text ("<|", "endoftext", "|>", or glued to a neighbour:
      ".<|") and its pieces get merged like any other text.
    - Ties: HF's merge heap orders equal counts by the pair of *ids*, smallest first. Its ids are:
      special tokens, then the 256 ByteLevel characters sorted by code point (so space, mapped to
      "Ġ" = U+0120, sorts after "~" and "ÿ"), then new tokens in creation order. lmfs takes the
      greatest pair of byte strings instead.

    ``hf_input`` replays the first two (else lmfs's own pre-token counts are used), ``hf_ties``
    the third. With both, the merges should be HF's exactly (until HF meets a merge whose string
    already exists: it then reuses that token's id, which shifts its later ids).
    """
    from lmfs.tokenization import count_pretokens_in_file, find_pretokens, learn_merges

    if hf_input:
        counts: Counter[str] = Counter()
        with open(path, "rb") as f:
            for line in f:  # binary mode splits at b"\n" only, as HF's reader does
                counts.update(find_pretokens(line.decode("utf-8")))
    else:
        counts = count_pretokens_in_file(path, [EOT])
    vocab = {i: bytes([i]) for i in range(256)} | {256: EOT.encode()}
    if not hf_ties:  # lmfs's rule: the greatest pair of byte strings
        return learn_merges(counts, vocab, vocab_size - len(vocab))
    # HF ids: 0 = the special token, 1..256 = bytes ordered by their ByteLevel character,
    # then merges in order (the same ids as lmfs's from 257 on).
    char = bytes_to_unicode()
    hf_id = {b: 1 + rank for rank, b in enumerate(sorted(range(256), key=char.__getitem__))}
    hf_id[256] = 0

    def tie_break(pair):  # the greatest key wins, so negate: the smallest HF ids win
        return tuple(-hf_id.get(t, t) for t in pair)

    return learn_merges_with_ties(counts, vocab, vocab_size - len(vocab), tie_break)


def first_difference(a: list, b: list) -> int:
    """Index of the first position where the lists differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_merges(ours: list, hf: list, replays: dict[str, list]) -> dict:
    n = min(len(ours), len(hf))
    k = first_difference(ours, hf)

    def has(merges, piece):  # how many merged tokens contain `piece`
        return sum(piece in a + b for a, b in merges)

    return {
        "n_ours": len(ours), "n_hf": len(hf),
        "identical_prefix": k,
        "first_difference": None if k >= n else {"index": k, "lmfs": ours[k], "hf": hf[k]},
        "same_position_fraction": sum(x == y for x, y in zip(ours, hf)) / max(n, 1),
        "in_hf_anywhere_fraction": len(set(ours) & set(hf)) / max(len(ours), 1),
        "replays": {name: {"identical_prefix": first_difference(r, hf), "n": len(r)} for name, r in replays.items()},
        "newline_merges": {"lmfs": has(ours, b"\n"), "hf": has(hf, b"\n")},
        "special_piece_merges": {"lmfs": sum(has(ours, p) for p in (b"<|", b"|>")),
                                 "hf": sum(has(hf, p) for p in (b"<|", b"|>"))},
    }


def encode_benchmark(path: Path, vocab: dict, merges: list, repeats: int) -> dict:
    from lmfs.tokenization import Tokenizer

    text = path.read_text(encoding="utf-8")
    n_bytes = len(text.encode("utf-8"))
    tok = Tokenizer(vocab, merges, [EOT])
    start = time.perf_counter()
    ours = tok.encode(text)
    cold = time.perf_counter() - start
    warm = min(_timed(tok.encode, text) for _ in range(repeats))

    enc = tiktoken_encoding(tok)
    theirs = enc.encode(text, allowed_special="all")
    tik = min(_timed(enc.encode, text, allowed_special="all") for _ in range(repeats))
    k = first_difference(ours, theirs)
    return {
        "bytes": n_bytes, "n_ids": len(ours),
        "lmfs_cold_mb_s": n_bytes / cold / 1e6, "lmfs_warm_mb_s": n_bytes / warm / 1e6,
        "tiktoken_mb_s": n_bytes / tik / 1e6,
        "ids_identical": ours == theirs,
        "first_id_difference": None if ours == theirs else k,
        "duplicate_tokens": len(vocab) - len(set(vocab.values())),
    }


def _timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def write_repeated(src: Path, dst: Path, times: int) -> None:
    with open(dst, "wb") as out:
        for _ in range(times):
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)


# ----------------------------------------------------------------------------------------------
# Report


def print_report(res: dict) -> None:
    cfg = res["config"]
    print(f"\nlmfs BPE benchmark: vocab {cfg['vocab_size']}, special token {EOT}, "
          f"{cfg['workers']} workers ({cfg['cpu_count']} CPU cores), best of {cfg['repeats']}")
    print("\n1. Training wall time (lmfs train_bpe vs HF tokenizers BpeTrainer, same file and cores)")
    print(f"   {'corpus':<9}{'size MB':>9}{'lmfs s':>9}{'HF s':>9}{'lmfs/HF':>10}")
    for name, r in res["corpora"].items():
        t = r["train"]
        print(f"   {name:<9}{r['bytes'] / 1e6:>9.1f}{t['lmfs_s']:>9.2f}{t['hf_s']:>9.2f}{t['ratio']:>10.2f}")
    print("\n2. Encoding throughput, one thread, whole text (lmfs Tokenizer.encode vs tiktoken built from lmfs's merges)")
    print(f"   {'corpus':<9}{'lmfs cold':>11}{'lmfs warm':>11}{'tiktoken':>10}{'cold/tik':>10}{'warm/tik':>10}   (MB/s)")
    for name, r in res["corpora"].items():
        e = r["encode"]
        print(f"   {name:<9}{e['lmfs_cold_mb_s']:>11.2f}{e['lmfs_warm_mb_s']:>11.2f}{e['tiktoken_mb_s']:>10.2f}"
              f"{e['lmfs_cold_mb_s'] / e['tiktoken_mb_s']:>10.2f}{e['lmfs_warm_mb_s'] / e['tiktoken_mb_s']:>10.2f}")
    print("\n3a. lmfs ids == tiktoken ids on the whole text")
    for name, r in res["corpora"].items():
        e = r["encode"]
        verdict = "identical" if e["ids_identical"] else f"DIFFERENT from id #{e['first_id_difference']}"
        print(f"   {name:<9}{verdict} ({e['n_ids']:,} ids; tokens built twice by training: {e['duplicate_tokens']})")
    print("\n3b. lmfs merges vs HF merges")
    for name, r in res["corpora"].items():
        m = r["merges"]
        print(f"   {name}: {m['n_ours']} lmfs / {m['n_hf']} HF merges; identical for the first "
              f"{m['identical_prefix']}; same merge at the same rank: {m['same_position_fraction']:.1%}; "
              f"lmfs merges found anywhere in HF's: {m['in_hf_anywhere_fraction']:.1%}")
        if m["first_difference"]:
            d = m["first_difference"]
            print(f"      first difference, merge #{d['index']}: lmfs {d['lmfs']!r}, HF {d['hf']!r}")
        print(f"      merges containing a newline: lmfs {m['newline_merges']['lmfs']}, HF {m['newline_merges']['hf']}; "
              f"containing '<|' or '|>': lmfs {m['special_piece_merges']['lmfs']}, HF {m['special_piece_merges']['hf']}")
        print("      lmfs's trainer replaying HF's rules -> identical to HF for the first ... merges:")
        for label, r in m["replays"].items():
            print(f"        {label:<40}{r['identical_prefix']:>6} of {m['n_hf']}")
    print("      why they differ (HF source: Tokenizer::train_from_files and models/bpe/trainer.rs):")
    print("        - HF reads the file line by line and pre-tokenizes each line alone: no token crosses a newline;")
    print("        - HF does not split special tokens out of the training text: '<|endoftext|>' is trained on as text;")
    print("        - ties: HF takes the smallest pair of its ids (special, then the bytes ordered by their ByteLevel")
    print("          character, then merges by age); lmfs takes the greatest pair of byte strings.")
    mem = res.get("memory")
    if mem:
        print(f"\n4. encode_iterable over an open file ({mem['corpus']}): peak resident-memory growth")
        print(f"   {'file':<10}{'size MB':>9}{'ids':>14}{'MB/s':>8}{'RSS growth MB':>15}")
        for label, r in (("base", mem["base"]), ("10x", mem["10x"])):
            print(f"   {label:<10}{r['bytes'] / 1e6:>9.1f}{r['n_ids']:>14,}{r['bytes'] / r['seconds'] / 1e6:>8.2f}"
                  f"{(r['rss_peak'] - r['rss_before']) / 1e6:>15.1f}")
    print()


# ----------------------------------------------------------------------------------------------
# Main


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=30, help="size of each text in MiB (default 30)")
    p.add_argument("--vocab-size", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes / threads for training")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    p.add_argument("--json", type=Path, help="also write all results to this JSON file")
    p.add_argument("--workdir", type=Path, help="folder for the generated texts (default: a temporary one)")
    p.add_argument("--skip-memory", action="store_true", help="skip part 4 (it writes and streams a 10x file)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-args", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:  # internal: one measured run in a fresh process
        kwargs = json.loads(args.child_args)
        fn = {"train-lmfs": child_train_lmfs, "train-hf": child_train_hf, "stream": child_stream}[args.child]
        with open(args.child_out, "wb") as f:
            pickle.dump(fn(**kwargs), f)
        return None

    from lmfs.data.corpora import write_stdlib_source, write_stories

    own_tmp = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lmfs-bench-tok-")) if own_tmp else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    n_bytes = int(args.mb * 2**20)
    import tiktoken
    import tokenizers

    res = {"date": datetime.date.today().isoformat(), "device": cpu_name(),
           "python": platform.python_version(), "tokenizers": tokenizers.__version__,
           "tiktoken": tiktoken.__version__,
           "config": {"mb": args.mb, "vocab_size": args.vocab_size, "workers": args.workers,
                      "repeats": args.repeats, "cpu_count": os.cpu_count()}, "corpora": {}}
    hf_env = {"RAYON_RS_NUM_THREADS": str(args.workers), "RAYON_NUM_THREADS": str(args.workers)}
    try:
        paths = {"stories": workdir / "stories.txt", "stdlib": workdir / "stdlib.txt"}
        log(f"writing {len(paths)} texts of {n_bytes / 1e6:.1f} MB to {workdir}")
        write_stories(paths["stories"], n_bytes, seed=0)
        write_stdlib_source(paths["stdlib"], n_bytes)
        for name, path in paths.items():
            log(f"[{name}] training: lmfs and HF, {args.repeats} runs each, alternating")
            lmfs_runs, hf_runs = [], []
            for _ in range(args.repeats):
                lmfs_runs.append(run_child("train-lmfs", workdir, path=str(path), vocab_size=args.vocab_size,
                                           workers=args.workers))
                hf_runs.append(run_child("train-hf", workdir, hf_env, path=str(path), vocab_size=args.vocab_size))
            lmfs_s = min(r["seconds"] for r in lmfs_runs)
            hf_s = min(r["seconds"] for r in hf_runs)
            vocab, merges = lmfs_runs[0]["vocab"], lmfs_runs[0]["merges"]
            log(f"[{name}] lmfs {lmfs_s:.2f} s, HF {hf_s:.2f} s; encoding")
            encode = encode_benchmark(path, vocab, merges, args.repeats)
            log(f"[{name}] replaying HF's rules")
            replays = {
                "HF input (lines, EOT as text) + HF ties": hf_replay(str(path), args.vocab_size),
                "HF input + lmfs ties": hf_replay(str(path), args.vocab_size, hf_ties=False),
                "lmfs input + HF ties": hf_replay(str(path), args.vocab_size, hf_input=False),
            }
            res["corpora"][name] = {
                "bytes": path.stat().st_size,
                "train": {"lmfs_s": lmfs_s, "hf_s": hf_s, "ratio": lmfs_s / hf_s,
                          "lmfs_runs": [r["seconds"] for r in lmfs_runs], "hf_runs": [r["seconds"] for r in hf_runs],
                          "lmfs_merges": len(merges), "hf_merges": len(hf_runs[0]["merges"])},
                "encode": encode,
                "merges": compare_merges(merges, hf_runs[0]["merges"], replays),
            }
            if name == "stdlib":
                from lmfs.tokenization import Tokenizer

                Tokenizer(vocab, merges, [EOT]).save(workdir / "tok-stdlib")
        if not args.skip_memory:
            base, big = paths["stdlib"], workdir / "stdlib-x10.txt"
            log("[memory] streaming the base file, then a 10x copy, through encode_iterable")
            mem = {"corpus": "stdlib", "base": run_child("stream", workdir, tokdir=str(workdir / "tok-stdlib"),
                                                         path=str(base))}
            write_repeated(base, big, 10)
            try:
                mem["10x"] = run_child("stream", workdir, tokdir=str(workdir / "tok-stdlib"), path=str(big))
            finally:
                big.unlink(missing_ok=True)
            res["memory"] = mem
    finally:
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=_json_default) + "\n")
    return res


def _json_default(obj):
    if isinstance(obj, bytes):
        return obj.decode("latin-1")  # one character per byte: readable for ASCII, lossless
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(type(obj))


if __name__ == "__main__":
    main()
