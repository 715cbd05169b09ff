#!/usr/bin/env bash
# The runs behind benchmarks/RESULTS.md (about 25 minutes on the 2-core dev machine).
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/hetccl-bench
out=benchmarks
$B -o all -b 1K -e 1M -f 4 -n 20 -w 3 --vs gloo --no-progress --csv $out/unshaped_2x2_all_ops.csv
$B -o all -b 1K -e 1M -f 4 -n 20 -w 3 --vs gloo --layout 1,2,3 --interleave --no-progress --csv $out/unshaped_1_2_3_all_ops.csv
$B -b 4M -e 64M -f 4 -n 10 --vs gloo --no-progress --csv $out/unshaped_2x2.csv
HETCCL_SMALL_BYTES=0 $B -b 1M -e 16M -f 4 -n 10 --vs gloo --no-progress --csv $out/unshaped_2x2_island_plans.csv
$B -b 16M -e 16M -n 10 --vs gloo --layout 4 --no-progress --csv $out/one_island_4.csv
$B -o allreduce,allgather,reducescatter -b 16M -e 32M -f 2 -n 3 -w 1 --vs gloo --link-rate 1gbit --no-progress \
   --csv $out/shaped_2x2.csv
$B -b 16M -e 64M -f 2 -n 3 -w 1 --vs gloo --link-rate 1gbit --interleave --no-progress \
   --csv $out/shaped_2x2_interleaved.csv
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
