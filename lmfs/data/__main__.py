"""Write the embedded corpora to files: ``python -m lmfs.data stories|stdlib --mb N --out PATH``."""

import argparse

from lmfs.data.corpora import write_stdlib_source, write_stories


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmfs.data", description=__doc__)
    parser.add_argument("corpus", choices=["stories", "stdlib"])
    parser.add_argument("--mb", type=float, default=30.0, help="size in megabytes (10^6 bytes)")
    parser.add_argument("--seed", type=int, default=0, help="stories only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    n_bytes = int(args.mb * 1e6)
    if args.corpus == "stories":
        path = write_stories(args.out, n_bytes, seed=args.seed)
    else:
        path = write_stdlib_source(args.out, n_bytes)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
