#!/usr/bin/env bash
# The runs behind benchmarks/RESULTS.md's current figures (about 30 minutes on the 2-core dev
# machine); the first two sections' tables: python benchmarks/floor_table.py (see RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/hetccl-bench
out=benchmarks
# collectives on one host vs Ray's gloo, floor sizes 1 KiB..16 MiB, two runs per layout
for r in 1 2; do
  $B -o all -b 1K -e 16M -f 4 -n 10 -w 3 --vs gloo --no-progress --csv $out/floors_22_r$r.csv
  $B -o all -b 1K -e 16M -f 4 -n 10 -w 3 --vs gloo --layout 1,2,3 --interleave --no-progress --csv $out/floors_123_r$r.csv
done
# across a shaped 1 Gbit/s border: 1 MiB, then 16 and 32 MiB, against the link bound
S="-o allreduce,reducescatter,allgather,broadcast,reduce,alltoall --vs gloo --link-rate 1gbit --no-progress"
$B $S -b 1M -e 1M -n 10 -w 2 --csv $out/shaped_1m.csv
$B $S -b 16M -e 32M -f 2 -n 3 -w 1 --csv $out/shaped_16m_32m.csv
# one island of 4 (the vendor op alone)
$B -b 16M -e 16M -n 10 --vs gloo --layout 4 --no-progress --csv $out/one_island_4.csv
# all-to-all (issue 12)
$B -o alltoall -b 1K -e 16M -f 16 -n 10 -w 2 --vs gloo --no-progress --csv $out/unshaped_2x2_alltoall.csv
$B -o alltoall -b 1K -e 1M -f 32 -n 10 -w 2 --vs gloo --layout 1,2,3 --interleave --no-progress \
   --csv $out/unshaped_1_2_3_alltoall.csv
$B -o alltoall -b 16M -e 32M -f 2 -n 3 -w 1 --vs gloo --link-rate 1gbit --no-progress --csv $out/shaped_2x2_alltoall.csv
# border compression (issue 11): real gradients / random bits, one hetccl group per mode side by side
C="-o allreduce -b 16M -e 32M -f 2 -n 5 -w 1 --link-rate 1gbit --no-progress"
$B $C --compress auto,off,on --data grads -d bfloat16 --csv $out/shaped_2x2_compress_bf16.csv
$B $C --compress auto,off,on --data grads -d float32 --csv $out/shaped_2x2_compress_fp32.csv
$B $C --compress auto,off --data random -d bfloat16 --csv $out/shaped_2x2_compress_random.csv
$B -o allreduce,allgather,alltoall -b 64K -e 16M -f 16 -n 10 -w 2 --compress auto,off --data grads -d bfloat16 \
   --no-progress --csv $out/unshaped_2x2_compress.csv
