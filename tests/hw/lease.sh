#!/bin/bash
# One run for a short GPU lease (issue 43), under 8 minutes, everything written under $OUT:
#   here first:  bash tests/hw/wheels.sh          (Ray and friends as wheels, in .whl/, ignored)
#   device run:  bash tests/hw/lease.sh           (carry [".whl"], timeout_s 540)
# 1. what the machine has; 2. tests/hw at HEAD (bridge and Ray Direct Transport included) with
# the caller's stream delayed before every input is written; 3. a software RDMA device
# (rdma_rxe) and, where one comes up, the RDMA border on host and GPU memory for real; 4. the
# GPU bench: two one-rank islands on one GPU, cross-island allreduce 1-256 MiB against Ray's
# gloo on host copies, with the staging and border bounds; 5. the CPU floor tables on the
# machine's cores (a core per rank), the shaped small broadcast included where netns works.
# Each step has its own deadline, so a hang in one still leaves the others' results.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lease}
mkdir -p "$OUT"
exec > >(tee "$OUT/lease.log") 2>&1
step() { echo; echo "== $1  ($(date +%T), ${SECONDS}s in)"; }

step "1. the machine"
nvidia-smi -L 2>&1; nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max --format=csv 2>&1
echo "cores $(nproc), $(free -g | awk '/Mem/{print $2}') GiB"; uname -r
ls /sys/class/infiniband 2>&1; lsmod 2>/dev/null | grep -E "nvidia_peermem|rdma_rxe|ib_core" || echo "no peermem/rxe/ib_core module loaded"
source tests/hw/install.sh || { echo "install failed ($?)"; exit 3; }

step "2. tests/hw at $(git rev-parse --short HEAD 2>/dev/null || echo HEAD), caller stream delayed"
HW_DELAY_CYCLES=20000000 PYTEST_ADDOPTS="--timeout=120" timeout 240 python3 tests/hw/run.py 2>&1 | tee "$OUT/hw.log" | tail -40

step "3. a software RDMA device"
netdev=$(ip -o route get 1.1.1.1 2>/dev/null | awk '{for (i=1;i<NF;i++) if ($i=="dev") print $(i+1)}')
if (modprobe rdma_rxe && rdma link add rxe0 type rxe netdev "${netdev:-lo}") 2>&1; then
    rdma link show 2>&1
    HETCCL_TRANSPORT=rdma PYTEST_ADDOPTS="--timeout=60 -k rdma" timeout 100 python3 tests/hw/run.py 2>&1 | tee "$OUT/rxe.log" | tail -15
else
    echo "no rxe device here (module or netlink refused): the RDMA border stays untried on hardware"
fi

step "4. GPU bench: two one-rank islands on one GPU"
timeout 120 python3 -m hetccl_ray.tools.bench -o allreduce -b 1M -e 256M -f 4 -w 2 -n 5 --layout 1,1 --device cuda \
    --vs gloo --no-progress --csv "$OUT/bench-gpu.csv" 2>&1 | grep -v "^(\|WARNING" | tee "$OUT/bench-gpu.txt" | tail -14
timeout 60 python3 -c "
from tests.hw.ops import staging_bound_s
for mib in (1, 64, 256):
    print(f'staging bound {mib} MiB: {staging_bound_s(mib << 20) * 1e3:.2f} ms (pinned, one copy each way)')" 2>&1

step "5. CPU floor tables, a core per rank ($(nproc) cores)"
for layout in 2x2 1,2,3; do
    timeout 75 python3 -m hetccl_ray.tools.bench -o all -b 1K -e 16M -f 16 -w 1 -n 5 --layout "$layout" --vs gloo \
        --no-progress --csv "$OUT/floors-$layout.csv" 2>&1 | grep -v "^(\|WARNING" | tail -12
done
timeout 60 python3 -m hetccl_ray.tools.bench -o broadcast -b 1K -e 1M -f 32 -w 1 -n 9 --layout 2x2 --vs gloo \
    --link-rate 1gbit --no-progress --csv "$OUT/shaped-broadcast.csv" 2>&1 | grep -v "^(\|WARNING" | tail -6
echo; echo "== done in ${SECONDS}s; files: $(ls "$OUT" | tr '\n' ' ')"
