#!/usr/bin/env bash
# Short-prompt time to first token against the process's CPU placement: the GPU's NUMA-local
# cores, the other cores, and no pinning, each in its own process (bench/prefill.py). Not a test.
#   bash bench/ttft_affinity.sh [LENGTHS] [REPEAT]
set -u
LENGTHS=${1:-1024}
REPEAT=${2:-9}
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f')
dev=/sys/bus/pci/devices/${bus: -12}
local_cpus=$(cat "$dev/local_cpulist" 2>/dev/null || echo "")
echo "GPU $bus, NUMA node $(cat "$dev/numa_node" 2>/dev/null), local CPUs: ${local_cpus:-unknown}"
lscpu | grep -iE "^CPU\(s\)|model name|NUMA|Thread\(s\)|MHz" || true
nproc
all=$(python3 -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))")
echo "this process may run on: $all"
other=$(python3 - "$local_cpus" "$all" <<'PY'
import sys
def parse(s):
    out = set()
    for part in filter(None, s.split(",")):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out
loc, allowed = parse(sys.argv[1]), parse(sys.argv[2])
rest = sorted(allowed - loc) or sorted(allowed)[len(allowed) // 2:]
print(",".join(map(str, rest)))
PY
)
run() {
  echo "=== $1"
  shift
  "$@" python3 bench/prefill.py --attention triton --lengths "$LENGTHS" --repeat "$REPEAT" --chunk 16384 2>&1 \
    | grep -E "TTFT|engine up"
}
run "no pinning" env
[ -n "$local_cpus" ] && run "pinned to the GPU-local CPUs $local_cpus" taskset -c "$local_cpus"
run "pinned to CPUs $other" taskset -c "$other"
run "no pinning (again)" env
[ -n "$local_cpus" ] && run "pinned to the GPU-local CPUs (again)" taskset -c "$local_cpus"
