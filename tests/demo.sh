#!/usr/bin/env bash
# make demo: three podman containers time-share one (fake) GPU under gpuplex.
#
# As root on Debian 12: starts the node service with one fake GPU, runs three busybox containers
# with busy loops and weights 1, 2 and 3 through podman with gpuplex's hooks, shows the execution
# windows live with `gpuplexctl top` for about 20 seconds, prints each container's share next to
# its weight, and removes everything it started. Everything lives under a temporary directory.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${GPUPLEX_BIN_DIR:-$repo/target/release}
seconds=${GPUPLEX_DEMO_SECONDS:-20}

if [ "$(id -u)" != 0 ]; then
	echo "make demo needs root: it runs podman containers and freezes their cgroups. Run: sudo make demo" >&2
	exit 1
fi
for b in containerd-shim-gpuplex-v1 gpuplexctl gpuplex-hook; do
	[ -x "$bin/$b" ] || { echo "demo: $bin/$b is not built; run make build" >&2; exit 1; }
done

work=$(mktemp -d /tmp/gpuplex-demo.XXXXXX)
service_pid=""
podman_() {
	CONTAINERS_CONF=$work/containers.conf podman --root "$work/podman/root" --runroot "$work/podman/runroot" \
		--tmpdir "$work/podman/tmp" --storage-driver vfs "$@"
}
cleanup() {
	podman_ rm -a -f -t 0 >/dev/null 2>&1 || true
	if [ -n "$service_pid" ]; then kill -TERM "$service_pid" 2>/dev/null || true; wait "$service_pid" 2>/dev/null || true; fi
	# podman's cleanup processes may still be writing its storage for a moment.
	for _ in $(seq 50); do rm -rf "$work" 2>/dev/null && break; sleep 0.1; done
}
trap cleanup EXIT

# One fake GPU: a character device node with the NVIDIA major; opening it in a container gives
# ENXIO (allowed, no driver) instead of EPERM.
mknod -m 666 "$work/fakegpu0" c 195 231
cat >"$work/gpuplex.toml" <<EOF
[scheduler]
slice = "200ms"
[service]
socket = "$work/gpuplex.sock"
state_dir = "$work/state"
activity = "cpu"
[[fake_gpu]]
uuid = "GPU-fake-0"
model = "Fake A100 (no real GPU)"
memory = "40Gi"
device = "$work/fakegpu0"
EOF
"$bin/containerd-shim-gpuplex-v1" serve --config "$work/gpuplex.toml" 2>"$work/service.log" &
service_pid=$!
for _ in $(seq 100); do [ -S "$work/gpuplex.sock" ] && break; sleep 0.05; done
ctl() { "$bin/gpuplexctl" --socket "$work/gpuplex.sock" "$@"; }
ctl status >/dev/null || { echo "demo: the node service did not start:" >&2; cat "$work/service.log" >&2; exit 1; }

# podman with gpuplex's hooks (config/hooks.d, pointed at the built hook and this config), and
# the workarounds these machines need (../shared/notes/container-stack.md §6).
mkdir -p "$work/hooks.d" "$work/rootfs/bin" "$work/rootfs/etc"
for stage in precreate createRuntime poststop; do
	sed -e "s|/usr/local/bin/gpuplex-hook|$bin/gpuplex-hook|" \
		-e "s|\"args\": \\[\"gpuplex-hook\", \"$stage\"\\]|\"args\": [\"gpuplex-hook\", \"--config\", \"$work/gpuplex.toml\", \"$stage\"]|" \
		"$repo/config/hooks.d/gpuplex-$stage.json" >"$work/hooks.d/gpuplex-$stage.json"
done
cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
hooks_dir = ["$work/hooks.d"]
EOF
cp /bin/busybox "$work/rootfs/bin/busybox"
for a in sh sleep cat true; do ln -s busybox "$work/rootfs/bin/$a"; done
echo 'root:x:0:0:root:/:/bin/sh' >"$work/rootfs/etc/passwd"

echo "gpuplex demo: three podman containers share ONE FAKE GPU (there is no GPU on this machine)."
echo "Each runs a busy loop; the cpu activity source stands in for GPU work. Weights 1, 2, 3."
echo
for w in 1 2 3; do
	podman_ run -d --name "weight$w" --runtime runc --network none \
		--annotation gpuplex.io/weight=$w --annotation gpuplex.io/gpu-memory=8Gi \
		--rootfs "$work/rootfs" sh -c 'while :; do :; done' >/dev/null
done
ctl top --interval 1s --count "$seconds"

echo
echo "Share of the GPU each container got over ${seconds}s (gpuplex's accounting):"
ctl status -o json | python3 "$repo/tests/demo_shares.py"
echo
echo "With real GPUs: install gpuplex (make install), leave out [[fake_gpu]] and use activity = \"auto\""
echo "(NVML) in /etc/gpuplex/gpuplex.toml, start the service (systemctl enable --now gpuplex), copy"
echo "config/hooks.d/*.json into podman's hooks directory, and run containers with gpuplex.io/ annotations."
