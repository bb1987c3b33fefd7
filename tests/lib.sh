# Shell fixtures shared by make demo (tests/demo.sh), the benchmarks and make soak (tests/soak/):
# the node service on one fake GPU, podman set up with gpuplex's hooks, a busybox rootfs.
# Source it with $work (a scratch directory), $bin (the built binaries) and $repo set.
# shellcheck shell=bash
# $work, $bin and $repo are the caller's:
# shellcheck disable=SC2154

# gpuplex_start_service MINOR MODEL MEMORY [SCHEDULER_LINE]: mknod a fake GPU (major 195), write
# $work/gpuplex.toml, start the node service in the background (its pid in $service_pid), wait
# for its socket.
gpuplex_start_service() {
	local minor=$1 model=$2 memory=$3 scheduler=${4:-}
	mknod -m 666 "$work/fakegpu0" c 195 "$minor"
	{
		echo "[scheduler]"
		echo "$scheduler"
		echo "[service]"
		echo "socket = \"$work/gpuplex.sock\""
		echo "state_dir = \"$work/state\""
		echo "activity = \"cpu\""
		echo "[[fake_gpu]]"
		echo "uuid = \"GPU-fake-0\""
		echo "model = \"$model\""
		echo "memory = \"$memory\""
		echo "device = \"$work/fakegpu0\""
	} >"$work/gpuplex.toml"
	"$bin/containerd-shim-gpuplex-v1" serve --config "$work/gpuplex.toml" 2>"$work/service.log" &
	service_pid=$!
	for _ in $(seq 100); do
		[ -S "$work/gpuplex.sock" ] && return 0
		sleep 0.05
	done
	echo "the node service did not start:" >&2
	cat "$work/service.log" >&2
	return 1
}

# gpuplex_four_gpus_config NAME MINOR: four fake GPUs of 16Gi (major 195, minors MINOR to
# MINOR+3, UUIDs GPU-NAME-0..3) and $work/gpuplex.toml for them: slice 200ms, the cpu activity
# source, high priority allowed outside Kubernetes and in the namespace "soak" (make soak and
# its kubelet check).
gpuplex_four_gpus_config() {
	local name=$1 minor=$2 i
	{
		echo "[scheduler]"
		echo 'slice = "200ms"'
		echo "[policy]"
		echo "high_priority_outside_kubernetes = true"
		echo 'high_priority_namespaces = ["soak"]'
		echo "[service]"
		echo "socket = \"$work/gpuplex.sock\""
		echo "state_dir = \"$work/state\""
		echo 'activity = "cpu"'
		for i in 0 1 2 3; do
			mknod -m 666 "$work/fakegpu$i" c 195 $((minor + i))
			echo "[[fake_gpu]]"
			echo "uuid = \"GPU-$name-$i\""
			echo "model = \"Fake $name GPU (no real GPU)\""
			echo 'memory = "16Gi"'
			echo "device = \"$work/fakegpu$i\""
		done
	} >"$work/gpuplex.toml"
}

# gpuplex_stop_service: SIGTERM (it thaws what it froze) and wait.
gpuplex_stop_service() {
	if [ -n "${service_pid:-}" ]; then
		kill -TERM "$service_pid" 2>/dev/null || true
		wait "$service_pid" 2>/dev/null || true
	fi
}

# gpuplex_podman_setup DIR [hooks]: containers.conf in DIR with the workarounds these machines
# need (../shared/notes/container-stack.md §6) and a hooks.d, holding config/hooks.d pointed at
# the built hook and $work/gpuplex.toml when the second argument is "hooks".
gpuplex_podman_setup() {
	local dir=$1 stage
	mkdir -p "$dir/hooks.d"
	if [ "${2:-}" = hooks ]; then
		for stage in precreate createRuntime poststop; do
			sed -e "s|/usr/bin/gpuplex-hook|$bin/gpuplex-hook|" \
				-e "s|\"args\": \\[\"gpuplex-hook\", \"$stage\"\\]|\"args\": [\"gpuplex-hook\", \"--config\", \"$work/gpuplex.toml\", \"$stage\"]|" \
				"$repo/config/hooks.d/gpuplex-$stage.json" >"$dir/hooks.d/gpuplex-$stage.json"
		done
	fi
	{
		echo "[containers]"
		echo 'default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]'
		echo "[engine]"
		echo 'cgroup_manager = "cgroupfs"'
		echo 'events_logger = "file"'
		echo "hooks_dir = [\"$dir/hooks.d\"]"
	} >"$dir/containers.conf"
}

# gpuplex_podman DIR ARGS...: podman with the setup in DIR and its storage there.
gpuplex_podman() {
	local dir=$1
	shift
	CONTAINERS_CONF=$dir/containers.conf podman --root "$dir/root" --runroot "$dir/runroot" \
		--tmpdir "$dir/tmp" --storage-driver vfs "$@"
}

# gpuplex_busybox_rootfs DIR APPLET...: a rootfs of Debian's busybox-static.
gpuplex_busybox_rootfs() {
	local root=$1 a
	shift
	mkdir -p "$root/bin" "$root/etc" "$root/dev" "$root/proc" "$root/sys"
	cp /bin/busybox "$root/bin/busybox"
	for a in "$@"; do ln -s busybox "$root/bin/$a"; done
	echo 'root:x:0:0:root:/:/bin/sh' >"$root/etc/passwd"
}

# gpuplex_remove_work: remove $work (podman's cleanup processes may write its storage a moment
# longer).
gpuplex_remove_work() {
	for _ in $(seq 50); do
		rm -rf "$work" 2>/dev/null && return 0
		sleep 0.1
	done
}
