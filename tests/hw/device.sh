#!/bin/bash
# On the GPU machine (device run, carry [".whl"] from tests/hw/wheels.sh): install the carried
# wheels beside the image's torch, then the hardware suite with a deadline per test.
#     HW_TOTAL=420 HW_TIMEOUT=200 HW_ARGS="-k rdt" bash tests/hw/device.sh
export PYTHONUNBUFFERED=1
source tests/hw/install.sh || exit $?
nvidia-smi -L
export PYTEST_ADDOPTS="--timeout=${HW_TIMEOUT:-150} ${HW_ARGS:-}"
timeout "${HW_TOTAL:-420}" python3 tests/hw/run.py 2>&1 | tee "$OUT/hw.log"
rc=${PIPESTATUS[0]}
cd /tmp/ray 2>/dev/null && tar czf "$OUT/raylogs.tgz" $(ls -d session_2*/logs | tail -6) 2>/dev/null
exit "$rc"
