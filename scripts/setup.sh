#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv with the CPU build of torch and hetccl_ray[test],
# plus pyverbs (Debian's python3-pyverbs, rdma-core's bindings) so the RDMA border imports.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0          # the CPU build; never a CUDA one here
.venv/bin/python -m pip install -q -e ".[test]"
bash scripts/install_pyverbs.sh
