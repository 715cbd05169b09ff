#!/bin/bash
# Here, before a device run: what the GPU machine lacks, as Python 3.12 x86-64 wheels in .whl/
# (ignored): Ray 2.60 slimmed under the 64 MiB carry limit (its jars, dashboard build, rllib,
# serve and llm dropped: 79 -> 42 MB), zstandard, jsonschema and its needs.
#     bash tests/hw/wheels.sh      # then device run: bash tests/hw/device.sh, carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
mkdir -p .whl
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d .whl ray==2.60.0 zstandard jsonschema jsonschema-specifications referencing rpds-py
python3 - <<'PY'
import glob, os, zipfile
src = glob.glob(".whl/ray-2.60.0-*.whl")[0]
drop = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/llm/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(".whl/ray-slim.zip", "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if not info.filename.startswith(drop):
            zout.writestr(info, zin.read(info.filename))  # keeps the mode bits (raylet, gcs_server)
os.remove(src)
PY
du -sh .whl
