#!/usr/bin/env bash
# Download, here (where pip reaches PyPI), the wheels the engine needs on the GPU machine but that its
# image lacks: pydantic and what pydantic needs beyond that image (CPython 3.12, manylinux x86_64).
# They land in .whl/ at the repo root (ignored by git); benchmarks/gpu_check.sh installs them there
# with pip --no-index when `import pydantic` fails. Carry them to the device: carry [".whl"].
#
#   bash benchmarks/gpu_wheels.sh            # PIP_PYTHON=... to use another interpreter's pip
#
# Versions are the ones the project's venv runs (tested here). typing-extensions is on the machine,
# but pydantic 2.14 requires >= 4.16.0, newer than the image may hold, so it travels too.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP_PYTHON=${PIP_PYTHON:-python3}
WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)

exclude=.git/info/exclude
if [ -d .git/info ] && ! grep -qxF '/.whl/' "$exclude" 2>/dev/null; then
  echo '/.whl/' >>"$exclude"
fi
rm -rf .whl
mkdir -p .whl
"$PIP_PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

# Every Requires-Dist (outside extras) must be among the wheels or on the machine already.
for wheel in .whl/*.whl; do
  unzip -p "$wheel" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' |
    sed "s|^|  $(basename "$wheel"): |" || true
done
echo "gpu_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
