"""Write the embedded corpora or a crawl to files.

    python -m lmfs.data stories|stdlib --mb N --out PATH      generated stories / the stdlib's source
    python -m lmfs.data crawl --out crawl.warc.gz [--roots DIR ...] [--max-pages N]
                                                              HTML pages packed into a WARC file
"""

import argparse

from lmfs.data.corpora import write_stdlib_source, write_stories


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmfs.data", description=__doc__,
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
    if args.corpus == "crawl":
        from lmfs.data.warc import pack_crawl
        path, source = pack_crawl(args.out, args.max_pages, roots=args.roots, seed=args.seed)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {source}")
        return
    n_bytes = int(args.mb * 1e6)
    if args.corpus == "stories":
        path = write_stories(args.out, n_bytes, seed=args.seed)
    else:
        path = write_stdlib_source(args.out, n_bytes)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
