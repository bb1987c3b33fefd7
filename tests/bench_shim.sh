#!/usr/bin/env bash
# What gpuplex's containerd shim costs a container's start, as ratios measured in one run
# (docs/benchmarks.md): `ctr run --rm` of a `true` container through io.containerd.gpuplex.v1
# vs containerd's own io.containerd.runc.v2, both without annotations, and through gpuplex with
# a vGPU (gpuplex.io/gpu-memory) vs runc.v2.
# Root; needs hyperfine, containerd, busybox-static and a release build (make build).
# GPUPLEX_BENCH_RUNS sets the runs (default 30).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${GPUPLEX_BIN_DIR:-$repo/target/release}
runs=${GPUPLEX_BENCH_RUNS:-30}
[ "$(id -u)" = 0 ] || { echo "bench_shim.sh needs root" >&2; exit 1; }

work=$(mktemp -d /tmp/gpuplex-bench-shim.XXXXXX)
# shellcheck source=tests/lib.sh
. "$repo/tests/lib.sh"
containerd_pid=
cleanup() {
	if [ -n "$containerd_pid" ]; then
		kill "$containerd_pid" 2>/dev/null || true
		wait "$containerd_pid" 2>/dev/null || true
	fi
	# The shims outlive containerd by design; those of this run go with it.
	pkill -9 -f "containerd-shim-gpuplex-v1 -namespace bench" 2>/dev/null || true
	pkill -9 -f "containerd-shim-runc-v2 -namespace bench" 2>/dev/null || true
	gpuplex_stop_service
	umount -R "$work/containerd" 2>/dev/null || true
	gpuplex_remove_work
}
trap cleanup EXIT

gpuplex_start_service 233 "Fake A100" 80Gi
gpuplex_busybox_rootfs "$work/rootfs" sh true
mkdir -p "$work/bin" "$work/containerd"
ln -s "$bin/containerd-shim-gpuplex-v1" "$work/bin/"
cat >"$work/containerd/config.toml" <<EOF
version = 2
root = "$work/containerd/root"
state = "$work/containerd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$work/containerd/containerd.sock"
[ttrpc]
  address = "$work/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$work/containerd/opt"
EOF
GPUPLEX_CONFIG=$work/gpuplex.toml PATH=$work/bin:$PATH \
	containerd --config "$work/containerd/config.toml" >"$work/containerd.log" 2>&1 &
containerd_pid=$!
ctr="ctr --address $work/containerd/containerd.sock -n bench"
for _ in $(seq 100); do $ctr version >/dev/null 2>&1 && break; sleep 0.05; done

run_cmd() { # runtime, name, extra args...
	local runtime=$1 name=$2
	shift 2
	echo "$ctr run --rootfs --rm --env PATH=/bin --runtime $runtime $* $work/rootfs $name true"
}
runc_v2=$(run_cmd io.containerd.runc.v2 b-runc)
gpuplex=$(run_cmd io.containerd.gpuplex.v1 b-gpuplex)
vgpu=$(run_cmd io.containerd.gpuplex.v1 b-vgpu --annotation gpuplex.io/gpu-memory=1Gi)

hyperfine --warmup 3 --runs "$runs" --export-json "$work/shim.json" \
	-n "ctr run --rm (io.containerd.runc.v2)" "$runc_v2" \
	-n "ctr run --rm (io.containerd.gpuplex.v1)" "$gpuplex" \
	-n "ctr run --rm (io.containerd.gpuplex.v1, with a vGPU)" "$vgpu"

# The same pairs interleaved (A B A B ...), so that the VM's drift lands on both sides.
python3 - "$runs" "$work/shim.json" "$runc_v2" "$gpuplex" "$vgpu" <<'PY'
import json, statistics, subprocess, sys, time
runs, exported, runc_v2, gpuplex, vgpu = sys.argv[1:]
results = json.load(open(exported))["results"]
print()
print("hyperfine (each command's runs in a row):")
for r in results[1:]:
    print(f"{r['command']}: median {r['median']*1e3:.1f} ms vs {results[0]['median']*1e3:.1f} ms: "
          f"ratio {r['median']/results[0]['median']:.3f} (goal <= 1.10)")
def timed(cmd):
    start = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start
print()
print(f"interleaved ({runs} pairs each):")
for name, a in (("gpuplex vs runc.v2", gpuplex), ("gpuplex with a vGPU vs runc.v2", vgpu)):
    ta, tb = [], []
    for _ in range(int(runs)):
        ta.append(timed(a))
        tb.append(timed(runc_v2))
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(f"{name}: median {ma*1e3:.1f} ms vs {mb*1e3:.1f} ms: ratio {ma/mb:.3f} (goal <= 1.10)")
PY
