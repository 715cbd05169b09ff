#!/bin/bash
# Sourced on the GPU machine (device run, carrying .whl from tests/hw/wheels.sh): installs the
# carried wheels beside the image's torch into /tmp/site and puts them on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 3
python3 - <<'PY' || return 4
import os, zipfile  # no unzip there; zipfile alone drops the mode bits Ray's binaries need
archive = zipfile.ZipFile(".whl/ray-slim.zip")
for info in archive.infolist():
    path = archive.extract(info, "/tmp/site")
    if info.external_attr >> 16:
        os.chmod(path, (info.external_attr >> 16) & 0o7777)
PY
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import ray, torch, hetccl_ray; print('ray', ray.__version__, 'torch', torch.__version__, torch.cuda.is_available())" || return 5
