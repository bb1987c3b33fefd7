# make soak's safety net (sourced by soak.sh, whose cleanup calls these whatever happened): what
# the run's processes, containerd and mounts may have left, found by the run's directory $work.
# On a run that went well there is nothing left for them to do.
# shellcheck shell=bash
# $work is soak.sh's:
# shellcheck disable=SC2154

# soak_pids_naming TEXT: the pids of the processes one of whose arguments contains TEXT.
soak_pids_naming() {
	local p
	for p in /proc/[0-9]*; do
		[ "${p#/proc/}" != $$ ] || continue
		tr '\0' '\n' 2>/dev/null <"$p/cmdline" | grep -qF -- "$1" && echo "${p#/proc/}"
	done
	return 0
}

# soak_end SIGNAL WHAT PID...: SIGCONT and SIGNAL to each pid, up to 10 s for them to end, then
# SIGKILL; each one said on stderr as WHAT.
soak_end() {
	local sig=$1 what=$2 pid
	shift 2
	[ $# -gt 0 ] || return 0
	echo "make soak: ending $what left running: $*" >&2
	for pid in "$@"; do kill -CONT "$pid" 2>/dev/null; kill "-$sig" "$pid" 2>/dev/null; done
	for _ in $(seq 100); do
		local left=0
		for pid in "$@"; do [ -d "/proc/$pid" ] && left=1; done
		[ "$left" = 1 ] || return 0
		sleep 0.1
	done
	for pid in "$@"; do kill -KILL "$pid" 2>/dev/null; done
	return 0
}

# soak_empty_cgroup DIR: thaw it, kill what is left in it (saying so), remove it.
soak_empty_cgroup() {
	local d=$1 procs
	[ -d "$d" ] || return 0
	[ -f "$d/freezer.state" ] && echo THAWED >"$d/freezer.state" 2>/dev/null
	[ -f "$d/cgroup.freeze" ] && echo 0 >"$d/cgroup.freeze" 2>/dev/null
	procs=$(cat "$d/cgroup.procs" 2>/dev/null | tr '\n' ' ')
	if [ -n "$procs" ]; then
		echo "make soak: killing processes left in $d: $procs" >&2
		# shellcheck disable=SC2086
		kill -KILL $procs 2>/dev/null
		for _ in $(seq 50); do [ -s "$d/cgroup.procs" ] || break; sleep 0.1; done
	fi
	rmdir "$d" 2>/dev/null || echo "make soak: left $d (it still has processes)" >&2
	return 0
}

# soak_services_cleanup: node services a containerd shim started (not the supervisor's, whose
# pid files soak.sh reads) and watchdogs; SIGTERM first, so that they thaw what they froze.
soak_services_cleanup() {
	# shellcheck disable=SC2046
	soak_end TERM "node service" $(soak_pids_naming "$work/gpuplex.toml")
	# shellcheck disable=SC2046
	soak_end TERM "watchdog" $(soak_pids_naming "$work/state")
}

# soak_containerd_cleanup: the run's containerd containers removed, containerd stopped, its
# shims ended, the cgroups of its namespace emptied and removed, the shims' sockets (named by a
# hash of containerd's address, the namespace and the container id) removed.
soak_containerd_cleanup() {
	local ns sock id h hier
	ns=$(cat "$work/containerd.namespace" 2>/dev/null) || return 0
	sock=$work/containerd/containerd.sock
	ctr_() { timeout 30 ctr --address "$sock" --namespace "$ns" "$@" </dev/null; }
	if [ -S "$sock" ] && ctr_ version >/dev/null 2>&1; then
		for id in $(ctr_ container ls -q 2>/dev/null); do
			echo "make soak: removing containerd container $id left behind" >&2
			ctr_ task rm -f "$id" >/dev/null 2>&1
			ctr_ container rm "$id" >/dev/null 2>&1
		done
	fi
	# shellcheck disable=SC2046
	soak_end TERM containerd $(soak_pids_naming "$work/containerd/config.toml")
	# shellcheck disable=SC2046
	soak_end KILL "containerd shim" $(soak_pids_naming "$sock")
	for hier in /sys/fs/cgroup/*/"$ns" /sys/fs/cgroup/"$ns"; do
		[ -d "$hier" ] || continue
		for id in "$hier"/*/; do soak_empty_cgroup "${id%/}"; done
		rmdir "$hier" 2>/dev/null || echo "make soak: left $hier" >&2
	done
	while read -r id; do
		h=$(printf '%s' "$sock/$ns/$id" | sha256sum | cut -d' ' -f1)
		[ -S "/run/containerd/s/$h" ] && rm -f "/run/containerd/s/$h"
	done < <(sort -u "$work/containerd-ids.txt" 2>/dev/null)
	rmdir "/run/containerd/runc/$ns" 2>/dev/null
	# containerd's directories in /run, where the run made them (runc, the shims' sockets)
	for h in /run/containerd/s /run/containerd/runc /run/containerd; do
		grep -qxF "$h" "$work/run-dirs-before.txt" 2>/dev/null || rmdir "$h" 2>/dev/null
	done
	return 0
}

# soak_unmount_under DIR: every mount below DIR unmounted, deepest first.
soak_unmount_under() {
	local m
	awk -v d="$1/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
		while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
}
