#!/usr/bin/env bash
# The README's Python front door, as a new user meets it: a fresh clone of this checkout's commit
# (committed files only), a fresh virtual environment, `pip install ".[torch]"` with nothing
# prepared (pip brings the build tools and torch; the build brings the CUTLASS headers), then the
# README's PyTorch example (the ```python block after its `<!-- ci: readme-snippet -->` marker).
# With a CUDA toolkit the package carries the kernels; their objects come from ccache when the
# CUDA configuration was built before (scripts/test.sh), so CI compiles them once.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
work=$PWD/${FUSEKIT_FRESH_DIR:-build-fresh}
rm -rf "$work" && mkdir -p "$work"
git clone -q --no-local "$PWD" "$work/fusekit"
python3 -m venv "$work/venv"
cd "$work/fusekit"
# ccache shares objects with the other build folders (as scripts/setup.sh sets it up); CI's own
# warnings-as-errors setting, as the other configurations build with it.
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
command -v ccache >/dev/null && export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
[ -z "${FUSEKIT_WERROR:-}" ] || export CMAKE_ARGS="${CMAKE_ARGS:-} -DFUSEKIT_WERROR=$FUSEKIT_WERROR"
"$work/venv/bin/python" -m pip install -q ".[torch]"
echo "test-fresh-install: pip install \".[torch]\" in a fresh clone and environment took $(( $(date +%s) - start )) s"
snippet=$(awk '/<!-- ci: readme-snippet -->/ {found = 1; next}
               found && /^```python/ {inside = 1; next}
               inside && /^```/ {exit}
               inside {print}' README.md)
if [ -z "$snippet" ]; then
  echo "test-fresh-install: README.md has no \`\`\`python block after <!-- ci: readme-snippet -->" >&2
  exit 1
fi
cd "$work"  # not the checkout: the installed package, not python/fusekit, is imported
printf '%s\n' "$snippet" | "$work/venv/bin/python" -
echo "test-fresh-install: the README's example ran ($(( $(date +%s) - start )) s)"
