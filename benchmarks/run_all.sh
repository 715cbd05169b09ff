#!/usr/bin/env bash
# The runs behind benchmarks/RESULTS.md (about 10 minutes on the 2-core dev machine).
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/hetccl-bench
out=benchmarks
$B -b 16M -e 64M -f 2 -n 3 -w 1 --vs gloo --link-rate 1gbit --no-progress --csv $out/shaped_2x2.csv
$B -b 16M -e 64M -f 2 -n 3 -w 1 --vs gloo --link-rate 1gbit --interleave --no-progress --csv $out/shaped_2x2_interleaved.csv
$B -b 64K -e 64M -f 4 -n 10 --vs gloo --no-progress --csv $out/unshaped_2x2.csv
HETCCL_PIECE_BYTES=67108864 $B -b 16M -e 16M -n 10 --vs gloo --no-progress --csv $out/unshaped_2x2_unpipelined.csv
$B -b 16M -e 16M -n 10 --vs gloo --layout 4 --no-progress --csv $out/one_island_4.csv
$B -o all -b 1K -e 4M -f 16 -n 5 --vs gloo --layout 1,2,3 --interleave --no-progress --csv $out/all_ops_1_2_3.csv
