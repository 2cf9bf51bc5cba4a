"""``python -m lmfs.alignment data``: rebuild the alignment data files in ``data/alignment/``.
``python -m lmfs.alignment report --scale full``: train (or load) the base and SFT models and print
their held-out accuracies, the numbers that size them (see ``lmfs.scales``, lecture "15")."""

import argparse

from lmfs.alignment.tasks import DATA_DIR, write_data

parser = argparse.ArgumentParser(prog="python -m lmfs.alignment", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("command", choices=["data", "report"])
parser.add_argument("--out", default=str(DATA_DIR), help="data: folder to write to (default: %(default)s)")
parser.add_argument("--scale", default="auto", help="report: smoke, full or auto (default: %(default)s)")
parser.add_argument("--device", default="auto", help="report: cpu, cuda or auto (default: %(default)s)")
args = parser.parse_args()
if args.command == "data":
    for path in write_data(args.out):
        print(f"wrote {path} ({path.stat().st_size:,} bytes, {sum(1 for _ in open(path))} rows)")
else:
    from lmfs.alignment.base import report

    report(args.scale, args.device)
