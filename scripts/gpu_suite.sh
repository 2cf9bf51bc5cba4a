#!/usr/bin/env bash
# The GPU suite: run on a GPU machine (e.g. one H200) from the repository root, with the
# wheelhouse made by `make wheelhouse` beside it. It
#   1. installs .wheelhouse/*.whl into a temporary folder (no network needed),
#   2. runs the GPU-marked unit tests (and the rest of the unit tests, on the GPU's Python),
#   3. runs every lecture notebook at full scale with papermill,
#   4. renders the executed notebooks to the book: HTML pages with an index (lmfs.lectures book),
#   5. runs the GPU benchmarks listed in GPU_BENCHES (e.g. "train-step kernels attention probes";
#      on 2 GPUs also "collectives data-parallel"),
#   6. writes a report to $OUT (default build/gpu): report.md, lectures.json, pytest.log,
#      bench-*.json, notebooks.tar.gz (the executed notebooks, with their outputs) and book/
#      (open book/index.html).
# A failing step is recorded and the suite goes on; the exit code is non-zero if any step failed.
# TESTS (default "tests") and LECTURES (default: all; e.g. "02 05") narrow steps 2 and 3;
# "none" skips one; PACK=1 leaves $OUT as one archive. LMFS_GPU_MEMORY_GB=22 caps each lecture's GPU memory as a 24 GB card would
# (lmfs.env.apply_memory_cap); the lecture table records each lecture's peak either way.
# LECTURE_JOBS=6 runs six lectures at a time on the GPU (lmfs.lectures run --jobs): all 17 at full
# scale, each slower than alone; lectures.json is rewritten as each finishes.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
SITE=${SITE:-/tmp/lmfs-site}
GPU_BENCHES=${GPU_BENCHES:-}
LECTURE_TIMEOUT=${LECTURE_TIMEOUT:-600}
TESTS=${TESTS:-tests}
LECTURES=${LECTURES:-}
LECTURE_JOBS=${LECTURE_JOBS:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ls .wheelhouse/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .wheelhouse/*.whl \
    || { echo "wheelhouse install failed"; exit 1; }
  # pip --target leaves out a wheel's data files; nbconvert keeps its HTML templates there
  # (share/jupyter/nbconvert/templates), so unpack them and point Jupyter at them.
  python3 scripts/wheel_data.py "$SITE/share/jupyter" .wheelhouse/*.whl || { echo "wheel data unpack failed"; exit 1; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" JUPYTER_PATH="$SITE/share/jupyter"
  # The Debian pages lectures 13 and 14 read, where the machine lacks the packages (lmfs.data.warc).
  if [ -f .wheelhouse/debian-docs.tar.xz ] && [ -z "${LMFS_DOC_ROOTS:-}" ] && ! ls -d /usr/share/debian-reference >/dev/null 2>&1; then
    mkdir -p "$SITE/docs" && tar -xJf .wheelhouse/debian-docs.tar.xz -C "$SITE/docs" \
      && export LMFS_DOC_ROOTS="$(ls -d "$SITE"/docs/usr/share/doc/python3*/html | head -1):$SITE/docs/usr/share/debian-reference"
  fi
else
  echo "no .wheelhouse/ here: run 'make wheelhouse' on a machine with network and carry it" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=()
report="$OUT/report.md"
{
  echo "# GPU suite report"
  echo
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -5
  python3 -c "import lmfs.env as e, torch; print(e.banner('full', e.resolve_device('auto')))" 2>&1
  echo "Debian pages: ${LMFS_DOC_ROOTS:-the installed packages, if any}; GPU memory cap: ${LMFS_GPU_MEMORY_GB:-none} GiB"
  echo '```'
} > "$report"

if [ "$TESTS" != none ]; then
  echo "== unit tests (GPU-marked and the rest): $TESTS =="
  start=$(date +%s)
  python3 -m pytest -q -n 4 --dist loadfile -p no:cacheprovider $TESTS -rs > "$OUT/pytest.log" 2>&1 || failed+=("unit tests")
  tail -n 25 "$OUT/pytest.log"
  { echo; echo "## Unit tests: $TESTS ($(( $(date +%s) - start )) s)"; echo; echo '```'; tail -n 15 "$OUT/pytest.log"; echo '```'; } >> "$report"
fi

if [ "$LECTURES" != none ]; then
  echo "== lectures at full scale: ${LECTURES:-all} =="
  python3 -m lmfs.lectures run --scale full --device cuda --out build/gpu-lectures --timeout "$LECTURE_TIMEOUT" \
    --jobs "$LECTURE_JOBS" ${LECTURES:+--only $LECTURES} || failed+=("lectures")
  cp build/gpu-lectures/lectures.json "$OUT/" 2>/dev/null
  { echo; echo "## Lectures (papermill, full scale)"; echo; cat build/gpu-lectures/lectures.md 2>/dev/null; } >> "$report"
  tar -czf "$OUT/notebooks.tar.gz" -C build gpu-lectures 2>/dev/null
  echo "== book =="
  python3 -m lmfs.lectures book --from build/gpu-lectures --out "$OUT/book" || failed+=("book")
fi

for bench in $GPU_BENCHES; do
  echo "== benchmark $bench =="
  { echo; echo "## Benchmark: $bench"; echo; echo '```'; } >> "$report"
  python3 -m lmfs.benchmarks "$bench" --json "$OUT/bench-$bench.json" 2>&1 | tee -a "$report" || failed+=("bench $bench")
  echo '```' >> "$report"
done

{ echo; echo "## Failed steps"; echo; if [ ${#failed[@]} -eq 0 ]; then echo none; else printf -- '- %s\n' "${failed[@]}"; fi; } >> "$report"
echo "report written to $report"
# PACK=1: everything in $OUT as one archive (a runner that returns a few files takes it whole).
if [ -n "${PACK:-}" ]; then
  tar -czf /tmp/gpu-suite.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu-suite.tar.gz "$OUT/" \
    && echo "packed into $OUT/gpu-suite.tar.gz"
fi
[ ${#failed[@]} -eq 0 ]
