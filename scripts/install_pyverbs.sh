#!/usr/bin/env bash
# pyverbs into .venv: Debian's python3-pyverbs (seconds; PyPI's pyverbs builds all of
# rdma-core), seen by the venv through a folder that holds only the pyverbs package, so
# none of Debian's other Python packages leak in. Without apt/root it says so and goes on:
# hetccl_ray then reports "pyverbs is not installed" and uses TCP.
set -euo pipefail
cd "$(dirname "$0")/.."
DIST=/usr/lib/python3/dist-packages
if [ ! -d "$DIST/pyverbs" ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q python3-pyverbs >/dev/null 2>&1 || {
            apt-get update -q >/dev/null 2>&1 && apt-get install -y -q python3-pyverbs >/dev/null; }
    else
        echo "install_pyverbs: no apt-get or not root; skipping pyverbs (the RDMA border will be unavailable)"
        exit 0
    fi
fi
LINKS=.venv/pyverbs-only
mkdir -p "$LINKS"
ln -sfn "$DIST/pyverbs" "$LINKS/pyverbs"
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$(pwd)/$LINKS" > "$SITE/hetccl-pyverbs.pth"
.venv/bin/python -c "import pyverbs.device; print('pyverbs', pyverbs.__file__)"
