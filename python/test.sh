#!/usr/bin/env bash
# The Python tests (tests/python), in one of two ways:
#
#   python/test.sh [BUILD_DIR]   (default build/) Adds the extension to an existing CMake build:
#                                reconfigures BUILD_DIR with MEGAMOE_BUILD_PYTHON=ON (every other
#                                cached option is kept), builds _megamoe and the megamoe program
#                                (only the extension is new when the C++ build is done), and runs
#                                pytest with PYTHONPATH=BUILD_DIR/python. What CI runs.
#   python/test.sh --pip         `pip install .` (the path a user takes; CUDA parts are compiled
#                                when nvcc is found unless MEGAMOE_ENABLE_CUDA=OFF), then pytest
#                                against the installed package.
#
# Installs numpy, pytest, nanobind and ml_dtypes with pip when they are missing. GPU tests skip
# with the reason printed (-rs) where torch, a CUDA device or the sm90 backend is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

need=()
for mod in numpy pytest nanobind ml_dtypes; do
  "$PYTHON" -c "import $mod" >/dev/null 2>&1 || need+=("$mod")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "python/test.sh: pip install ${need[*]}"
  "$PYTHON" -m pip install -q "${need[@]}" </dev/null
fi

if [ "${1:-}" = "--pip" ]; then
  start=$(date +%s)
  "$PYTHON" -m pip install -q . </dev/null
  echo "python/test.sh: pip install took $(( $(date +%s) - start )) s"
  # Run from outside the checkout so that `import megamoe` finds the installed package.
  cd tests/python
  exec "$PYTHON" -m pytest -q -rs -p no:cacheprovider .
fi

BUILD_DIR="${1:-build}"
mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
generator=(-G Ninja)
[ -f "$BUILD_DIR/CMakeCache.txt" ] && generator=()  # keep the generator of an existing build
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DMEGAMOE_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" >"$BUILD_DIR/python-configure.log" 2>&1 \
  || { cat "$BUILD_DIR/python-configure.log"; exit 1; }
targets=(_megamoe)
# The megamoe program serves a cross-check (tests compare with `megamoe run --json`).
if grep -q '^MEGAMOE_BUILD_TOOLS:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then
  targets+=(megamoe_cli)
  export MEGAMOE_CLI="$BUILD_DIR/megamoe"
fi
cmake --build "$BUILD_DIR" --target "${targets[@]}" -j "$(nproc)"
export PYTHONPATH="$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m pytest tests/python -q -rs
