"""Unpack the ``share/jupyter`` data files of wheels into a folder (used by gpu_suite.sh).

``pip install --target`` installs a wheel's code but not its data files (``NAME.data/data/...``).
nbconvert keeps its HTML templates there, so without them ``lmfs.lectures book`` cannot render.

    python scripts/wheel_data.py DEST WHEEL...
"""

import sys
import zipfile
from pathlib import Path

PREFIX = "/data/share/jupyter/"


def main(dest: str, *wheels: str) -> None:
    out = Path(dest)
    count = 0
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                head, sep, rest = name.partition(PREFIX)
                if sep and head.endswith(".data") and "/" not in head and rest and not name.endswith("/"):
                    target = out / rest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(name))
                    count += 1
    print(f"{count} Jupyter data files unpacked into {out}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], *sys.argv[2:])
