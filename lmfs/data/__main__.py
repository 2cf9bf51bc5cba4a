"""Write the embedded corpora or a crawl to files.

    python -m lmfs.data stories|stdlib --mb N --out PATH      generated stories / the stdlib's source
    python -m lmfs.data crawl --out crawl.warc.gz [--roots DIR ...] [--max-pages N]
                                                              HTML pages packed into a WARC file
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from lmfs.data.corpora import write_stdlib_source, write_stories

PROG = "python -m lmfs.data"


def _fail(message: str) -> None:
    """Exit with one line on stderr, the way a command-line tool reports a bad argument."""
    sys.exit(f"{PROG}: error: {message}")


def check_output_file(out: str) -> Path:
    """``out`` as a path, after checking that a file can be written there (its folder is created).

    Exits with one line naming ``--out`` when ``out`` is a folder (or ends with a separator) or
    when the folder cannot be created or written to, before any work starts.
    """
    path = Path(out)
    if out.endswith((os.sep, "/")) or path.is_dir():
        _fail(f"--out {out} is a folder: give a file name in it, e.g. {path / 'crawl.warc.gz'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        _fail(f"cannot write --out {out}: {err.strerror or err} (the folder {path.parent})")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", choices=["stories", "stdlib", "crawl"])
    parser.add_argument("--mb", type=float, default=30.0, help="size in megabytes (10^6 bytes)")
    parser.add_argument("--seed", type=int, default=0, help="stories, and crawl's generated sample")
    parser.add_argument("--roots", nargs="*", default=None,
                        help="crawl: folders of HTML pages (default: installed Debian documentation, "
                             "else a generated sample site)")
    parser.add_argument("--max-pages", type=int, default=100_000, help="crawl: at most this many pages")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = check_output_file(args.out)
    try:
        if args.corpus == "crawl":
            from lmfs.data.warc import pack_crawl
            path, source = pack_crawl(out, args.max_pages, roots=args.roots, seed=args.seed)
            print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {source}")
            return
        n_bytes = int(args.mb * 1e6)
        if args.corpus == "stories":
            path = write_stories(out, n_bytes, seed=args.seed)
        else:
            path = write_stdlib_source(out, n_bytes)
    except OSError as err:  # the disk filled up, the folder went away: one line, no half-written file
        out.with_name(out.name + ".part").unlink(missing_ok=True)
        _fail(f"writing --out {args.out} failed: {err.strerror or err} ({err.filename or out})")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
