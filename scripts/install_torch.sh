#!/usr/bin/env bash
# Install torch into the Python given as $1 (the Makefile passes .venv/bin/python), choosing the
# build before pip does: PyPI's Linux wheel of torch is the CUDA build (about 17 nvidia-* packages,
# several GB), which a laptop without an NVIDIA GPU does not want.
#
#   TORCH_SPEC   what to install (default torch==2.13.0)
#   TORCH_INDEX  an index URL to take torch from, overriding the choice below
#                (e.g. https://download.pytorch.org/whl/cu128 for another CUDA version)
#
# The choice, in order:
#   1. TORCH_INDEX set                     -> pip install --index-url $TORCH_INDEX $TORCH_SPEC
#   2. an NVIDIA GPU (nvidia-smi lists one) -> pip install $TORCH_SPEC: PyPI's CUDA build
#   3. not Linux (macOS, Windows)          -> pip install $TORCH_SPEC: PyPI's wheel is the CPU
#                                             (and on Apple silicon MPS) build there
#   4. Linux without a GPU                 -> the CPU build from PyTorch's CPU index
#                                             (https://download.pytorch.org/whl/cpu, about 200 MB)
#      if that index cannot be reached     -> pip install $TORCH_SPEC from pip's configured
#                                             indexes, with a warning: it is the CPU build only
#                                             where those offer one (a local CPU wheel in pip's
#                                             find-links, as on the course's build machines),
#                                             else PyPI's CUDA build, which also runs on a CPU.
# It ends by printing the torch that got installed and whether it is a CUDA build.
set -euo pipefail
PY=${1:?usage: install_torch.sh PYTHON}
SPEC=${TORCH_SPEC:-torch==2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu

if [ -n "${TORCH_INDEX:-}" ]; then
  echo "torch: $SPEC from TORCH_INDEX=$TORCH_INDEX"
  "$PY" -m pip install -q --index-url "$TORCH_INDEX" "$SPEC"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "torch: NVIDIA GPU found, $SPEC from the default index (the CUDA build)"
  "$PY" -m pip install -q "$SPEC"
elif [ "$(uname -s)" != Linux ]; then
  echo "torch: $SPEC from the default index (the CPU build on $(uname -s))"
  "$PY" -m pip install -q "$SPEC"
elif "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=10)" "$CPU_INDEX" 2>/dev/null; then
  echo "torch: no GPU, $SPEC from $CPU_INDEX (the CPU build)"
  "$PY" -m pip install -q --index-url "$CPU_INDEX" "$SPEC"
else
  echo "torch: no GPU and $CPU_INDEX unreachable: $SPEC from pip's configured indexes" \
       "(the CPU build only where they offer one; set TORCH_INDEX to choose)"
  "$PY" -m pip install -q "$SPEC"
fi
# -W: torch warns on import that numpy is missing, which it is until the package's turn.
"$PY" -W ignore::UserWarning -c "import torch; print('installed torch', torch.__version__,
      f'(the CUDA {torch.version.cuda} build)' if torch.version.cuda else '(the CPU build)')"
