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
# shellcheck source=tests/lib.sh
. "$repo/tests/lib.sh"
podman_() { gpuplex_podman "$work/podman" "$@"; }
cleanup() {
	podman_ rm -a -f -t 0 >/dev/null 2>&1 || true
	gpuplex_stop_service
	gpuplex_remove_work
}
trap cleanup EXIT

# One fake GPU: a character device node with the NVIDIA major; opening it in a container gives
# ENXIO (allowed, no driver) instead of EPERM.
gpuplex_start_service 231 "Fake A100 (no real GPU)" 40Gi 'slice = "200ms"'
ctl() { "$bin/gpuplexctl" --socket "$work/gpuplex.sock" "$@"; }
# podman with gpuplex's hooks (config/hooks.d, pointed at the built hook and this config).
gpuplex_podman_setup "$work/podman" hooks
gpuplex_busybox_rootfs "$work/rootfs" sh sleep cat true

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
echo "With real GPUs: make deb && apt install ./gpuplex_*.deb (the service starts with NVML's GPUs,"
echo "podman's hooks are in place), then run containers with gpuplex.io/ annotations; for containerd,"
echo "gpuplexctl install containerd and restart it. Without the package: make install, then"
echo "gpuplexctl install podman and systemctl enable --now gpuplex."
