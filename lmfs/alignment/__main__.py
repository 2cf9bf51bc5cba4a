"""The alignment lectures' data and models from the command line.

  python -m lmfs.alignment data                 rebuild the task files in data/alignment/
  python -m lmfs.alignment report --scale full  train (or load from the cache) the base and SFT
                                                models and print their held-out accuracies, the
                                                numbers that size them (lmfs/scales/alignment.py, lecture 15)
"""

import argparse


def main(argv=None) -> None:
    from lmfs.alignment.tasks import DATA_DIR, write_data

    parser = argparse.ArgumentParser(prog="python -m lmfs.alignment", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["data", "report"])
    parser.add_argument("--out", default=str(DATA_DIR), help="data: folder to write to (default: %(default)s)")
    parser.add_argument("--scale", default="auto", help="report: smoke, full or auto (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="report: cpu, cuda or auto (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "data":
        for path in write_data(args.out):
            print(f"wrote {path} ({path.stat().st_size:,} bytes, {sum(1 for _ in open(path))} rows)")
    else:
        from lmfs.alignment.base import report

        report(args.scale, args.device)


if __name__ == "__main__":
    main()
