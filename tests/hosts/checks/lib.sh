# Helpers of the host suite's checks (tests/hosts/checks/NN-*.sh), which run inside the test host
# as root, one after another, each in a shell of its own (tests/hosts/guest.sh). A check prints
# what it does and exits non-zero at the first thing that is wrong, its last line saying what.
# shellcheck shell=bash
set -euo pipefail

repo=$GPUPLEX_HOSTS_REPO
run=$GPUPLEX_HOSTS_RUN
# Scratch that outlives a check: the fake GPUs' nodes and the busybox rootfs.
var=/var/lib/gpuplex-hosts
conffile=/etc/gpuplex/gpuplex.toml
socket=/run/gpuplex/gpuplex.sock
mkdir -p "$var"

# fail WHY: what the node service says and its journal's end, then WHY as the last line.
fail() {
	{
		echo "--- gpuplexctl status"
		gpuplexctl status 2>&1 || true
		echo "--- journalctl -u gpuplex.service (last 30 lines)"
		journalctl -u gpuplex.service -n 30 --no-pager 2>&1 || true
		echo "---"
		echo "$*"
	} >&2
	exit 1
}

# oneline TEXT: TEXT on one line, for a check's last line.
oneline() { tr '\n' ' ' <<<"$1"; }

# Times are microseconds from bash's ${EPOCHREALTIME/./}, read without starting a process: under
# emulation a fork costs tens of milliseconds, which would blur what the checks time.

# wait_for SECONDS COMMAND...: runs COMMAND every 20 ms until it succeeds; fails after SECONDS.
wait_for() {
	local until=$((${EPOCHREALTIME/./} + $1 * 1000000))
	shift
	until "$@" >/dev/null 2>&1; do
		[ "${EPOCHREALTIME/./}" -lt "$until" ] || return 1
		sleep 0.02
	done
}

# ms_since MICROSECONDS: milliseconds since then.
ms_since() { echo $(((${EPOCHREALTIME/./} - $1) / 1000)); }

# The operator's conffile for two fake GPUs of different models (nodes nvidia0 and nvidia1 under
# $var, NVIDIA's major), with the cpu activity source: a container's CPU time stands for GPU work.
write_conffile() {
	mkdir -p "$var" /etc/gpuplex
	[ -c "$var/nvidia0" ] || mknod -m 666 "$var/nvidia0" c 195 0
	[ -c "$var/nvidia1" ] || mknod -m 666 "$var/nvidia1" c 195 1
	cat >"$conffile" <<EOF
[scheduler]
slice = "200ms"

[service]
activity = "cpu"

[[fake_gpu]]
uuid = "GPU-fake-0"
model = "Fake A100"
memory = "40Gi"
device = "$var/nvidia0"

[[fake_gpu]]
uuid = "GPU-fake-1"
model = "Fake H100"
memory = "80Gi"
device = "$var/nvidia1"
EOF
}

# A busybox rootfs for podman --rootfs and ctr --rootfs.
rootfs() {
	local root=$var/rootfs a
	if [ ! -x "$root/bin/busybox" ]; then
		mkdir -p "$root/bin" "$root/etc" "$root/dev" "$root/proc" "$root/sys" "$root/tmp" "$root/run"
		cp /bin/busybox "$root/bin/busybox"
		for a in sh ls cat sleep echo true test grep; do ln -sf busybox "$root/bin/$a"; done
		echo 'root:x:0:0:root:/:/bin/sh' >"$root/etc/passwd"
	fi
	echo "$root"
}

service_active() { [ "$(systemctl is-active gpuplex.service)" = active ]; }
main_pid() { systemctl show -P MainPID gpuplex.service; }
ctl() { gpuplexctl "$@"; }

# A cgroup v2 directory's freezer: frozen (1) or not (0), as the kernel reports it.
frozen() {
	local key value
	while read -r key value; do
		[ "$key" = frozen ] && echo "$value"
	done <"$1/cgroup.events"
}
# usage_usec of a cgroup v2 directory.
cpu_usec() { sed -n 's/^usage_usec //p' "$1/cpu.stat"; }

# The cgroup directory of a podman container's init process: the one gpuplex freezes (crun,
# podman 5's runtime, runs the container in a `container` cgroup inside podman's scope).
podman_cgroup() {
	local pid
	pid=$(podman inspect -f '{{.State.Pid}}' "$1")
	echo "/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$pid/cgroup")"
}

# busy_podman NAME WEIGHT MEMORY [MORE PODMAN ARGS]: a busy loop in a podman container with a vGPU.
busy_podman() {
	local name=$1 weight=$2 memory=$3
	shift 3
	podman run -d --name "$name" --network none --annotation "gpuplex.io/weight=$weight" \
		--annotation "gpuplex.io/gpu-memory=$memory" "$@" --rootfs "$(rootfs)" \
		sh -c 'while :; do :; done' >/dev/null
}

# all_thawed CGROUP...: none of them frozen (read without a subshell, to be quick).
all_thawed() {
	local c key value
	for c in "$@"; do
		while read -r key value; do
			[ "$key" = frozen ] && [ "$value" != 0 ] && return 1
		done <"$c/cgroup.events"
	done
	return 0
}

# some_frozen CGROUP...: at least one of them frozen.
some_frozen() { ! all_thawed "$@"; }

# took_turns SECONDS CGROUP...: within SECONDS each cgroup was seen both frozen and thawed.
took_turns() {
	local seconds=$1 c i state
	shift
	local -A seen=()
	for ((i = 0; i < seconds * 20; i++)); do
		for c in "$@"; do
			state=$(frozen "$c")
			seen[$c]="${seen[$c]:-}$state"
		done
		local all=yes
		for c in "$@"; do
			[[ ${seen[$c]} == *0* && ${seen[$c]} == *1* ]] || all=no
		done
		[ "$all" = yes ] && return 0
		sleep 0.05
	done
	for c in "$@"; do echo "$c: frozen samples ${seen[$c]}" >&2; done
	return 1
}
