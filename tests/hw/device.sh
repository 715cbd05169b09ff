#!/bin/bash
# On the GPU machine (device run, carry [".whl"] from tests/hw/wheels.sh): install the carried
# wheels beside the image's torch, then the hardware suite with a deadline per test.
#     HW_TOTAL=420 HW_TIMEOUT=200 HW_ARGS="-k rdt" bash tests/hw/device.sh
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 - <<'PY' || exit 4
import os, zipfile  # no unzip there; zipfile alone drops the mode bits Ray's binaries need
archive = zipfile.ZipFile(".whl/ray-slim.zip")
for info in archive.infolist():
    path = archive.extract(info, "/tmp/site")
    if info.external_attr >> 16:
        os.chmod(path, (info.external_attr >> 16) & 0o7777)
PY
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
python3 -c "import ray, torch, hetccl_ray; print('ray', ray.__version__, 'torch', torch.__version__, torch.cuda.is_available())" || exit 5
export PYTEST_ADDOPTS="--timeout=${HW_TIMEOUT:-150} ${HW_ARGS:-}"
timeout "${HW_TOTAL:-420}" python3 tests/hw/run.py 2>&1 | tee "$OUT/hw.log"
rc=${PIPESTATUS[0]}
cd /tmp/ray 2>/dev/null && tar czf "$OUT/raylogs.tgz" $(ls -d session_2*/logs | tail -6) 2>/dev/null
exit "$rc"
