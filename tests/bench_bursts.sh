#!/usr/bin/env bash
# make bench-bursts: bursty demand beside steady work on one fake GPU, with real podman
# containers under gpuplex's hooks, for the scheduler core before and after a change (#29).
#
# Root. For each load (idle; with GPUPLEX_BURST_STRESS=1 also stressed: every CPU kept busy by
# processes outside gpuplex), each case and each core (before, when GPUPLEX_BEFORE_BIN_DIR names
# its binaries, then after), a fresh node service (one fake GPU, slice 200ms, the cpu activity
# source: a container's CPU use is its GPU work) and fresh containers:
#   steady  three busy loops, weights 1, 2, 3; 5 s warm-up, 30 s measured: shares vs 1/6, 2/6, 3/6
#   bursty  the same three plus three bursty containers (weight 1): a gap (geometric in 10 ms
#           steps, mean 2 s), then a burst of 50-500 ms of running time; 5 s warm-up, then
#           GPUPLEX_BURST_SECONDS (default 60) measured
# tests/bench_bursts.py reads the node service's window events and the bursts' logs and prints a
# markdown row per run, then the table; the results are written as JSON (GPUPLEX_BURST_JSON,
# default /tmp/gpuplex-bench-bursts-<time>.json). GPUPLEX_BIN_DIR: the after binaries (default
# target/release); GPUPLEX_BURST_SEED: the bursts' seed (the same pattern for every run);
# GPUPLEX_BURST_KEEP=1 keeps the scratch directory (logs, events, each run's result).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
after=${GPUPLEX_BIN_DIR:-$repo/target/release}
before=${GPUPLEX_BEFORE_BIN_DIR:-}
seconds=${GPUPLEX_BURST_SECONDS:-60}
stress=${GPUPLEX_BURST_STRESS:-0}
keep=${GPUPLEX_BURST_KEEP:-0}
seed=${GPUPLEX_BURST_SEED:-29}
results=${GPUPLEX_BURST_JSON:-/tmp/gpuplex-bench-bursts-$(date +%Y%m%d-%H%M%S).json}
analyzer=$repo/tests/bench_bursts.py
warmup=5 steady_seconds=30 grace=3

die() { echo "bench_bursts: $*" >&2; exit 1; }
if [ "$(id -u)" != 0 ]; then
	die "needs root: it runs podman containers and freezes their cgroups (sudo make bench-bursts)"
fi
if ! [[ $seconds =~ ^[1-9][0-9]{0,3}$ ]] || [ "$seconds" -lt 5 ] || [ "$seconds" -gt 3600 ]; then
	die "GPUPLEX_BURST_SECONDS=$seconds: expected whole seconds from 5 to 3600"
fi
[[ $stress =~ ^[01]$ ]] || die "GPUPLEX_BURST_STRESS=$stress: expected 0 or 1"
[[ $keep =~ ^[01]$ ]] || die "GPUPLEX_BURST_KEEP=$keep: expected 0 or 1"
[[ $seed =~ ^[1-9][0-9]{0,3}$ ]] || die "GPUPLEX_BURST_SEED=$seed: expected a number from 1 to 9999"
[ -d "$(dirname "$results")" ] || die "GPUPLEX_BURST_JSON=$results: no such directory"
for b in containerd-shim-gpuplex-v1 gpuplexctl gpuplex-hook; do
	[ -x "$after/$b" ] || die "$after/$b is not built (cargo build --release --locked --bins)"
done
if [ -n "$before" ]; then
	for b in containerd-shim-gpuplex-v1 gpuplex-hook; do
		[ -x "$before/$b" ] || die "GPUPLEX_BEFORE_BIN_DIR: $before/$b is not built"
	done
fi
for c in podman runc python3; do
	command -v "$c" >/dev/null || die "$c is missing (make test-deps installs what tests/ needs)"
done
[ -x /bin/busybox ] || die "/bin/busybox is missing (apt-get install busybox-static)"

# Window holders always come from the after gpuplexctl (the before one has no `-o json`; the
# socket protocol is the same).
ctl() { "$after/gpuplexctl" --socket "$work/gpuplex.sock" "$@"; }

# Short paths: podman refuses a runroot over 50 characters (each run's is $top/runN/podman/runroot).
top=$(mktemp -d /tmp/gpuplex-bursts.XXXXXX)
work=$top # lib.sh's helpers use $work (the current run's directory) and $bin (its binaries)
bin=$after
service_pid=""
stress_pids=()
# shellcheck source=tests/lib.sh
. "$repo/tests/lib.sh"
podman_() { gpuplex_podman "$work/podman" "$@"; }

stop_run() {
	if [ -d "$work/podman" ]; then podman_ rm -a -f -t 0 >/dev/null 2>&1 || true; fi
	gpuplex_stop_service
	service_pid=""
}
stop_stress() {
	local p
	for p in "${stress_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
	for p in "${stress_pids[@]}"; do wait "$p" 2>/dev/null || true; done
	stress_pids=()
}
cleanup() {
	stop_run
	stop_stress
	work=$top
	if [ "$keep" = 1 ]; then echo "bench_bursts: kept $top"; else gpuplex_remove_work; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Every CPU busy outside gpuplex: stress-ng when installed, else one busy shell per core.
start_stress() {
	local n i
	n=$(nproc)
	if command -v stress-ng >/dev/null; then
		echo "stress: stress-ng --cpu $n (outside gpuplex)"
		stress-ng --cpu "$n" --quiet &
		stress_pids+=($!)
	else
		echo "stress: $n busy-loop shells (while :; do :; done), one per core, outside gpuplex"
		for ((i = 0; i < n; i++)); do
			sh -c 'while :; do :; done' &
			stress_pids+=($!)
		done
	fi
}

# A bursty container's loop (busybox ash; $SEED seeds $RANDOM, so every run replays the same
# gaps and amounts). Times are /proc/uptime in centiseconds (the host's: no time namespace).
# The gap: geometric in 10 ms steps with p = 164/32768 (mean about 2 s). The amount: 5-50 cs of
# running time, counted only between close reads (a jump over 30 ms is time spent frozen, not
# work). One line per burst in /log/bursts: intended start (read before sleeping + the gap),
# wake (first read after the sleep), end, amount; /log/current holds the burst pending or under
# way (intended start, amount, then its wake), which may not end before the containers go.
# shellcheck disable=SC2016
burst_loop='RANDOM=$SEED
while :; do
	g=0; while [ $RANDOM -ge 164 ]; do g=$((g + 1)); done
	a=$((5 + RANDOM % 46))
	read up _ </proc/uptime; t0=${up%.*}${up#*.}
	echo "$((t0 + g)) $a" >/log/current
	sleep $((g / 100)).$((g % 100 / 10))$((g % 10))
	read up _ </proc/uptime; w=${up%.*}${up#*.}
	echo "$((t0 + g)) $a $w" >/log/current
	p=$w; d=0
	while [ $d -lt $a ]; do
		read up _ </proc/uptime; c=${up%.*}${up#*.}
		d=$((d + (c - p <= 3 ? c - p : 0))); p=$c
	done
	echo "$((t0 + g)) $w $p $a" >>/log/bursts
done'

# start NAME ROLE WEIGHT [SEED]: one container through gpuplex's hooks; its id in containers.
start() {
	local name=$1 role=$2 weight=$3 id
	local args=(-d --name "$name" --runtime runc --network none
		--annotation "gpuplex.io/weight=$weight" --annotation gpuplex.io/gpu-memory=8Gi)
	if [ "$role" = bursty ]; then
		mkdir -p "$work/log-$name"
		args+=(-v "$work/log-$name:/log" -e "SEED=$4")
		id=$(podman_ run "${args[@]}" --rootfs "$work/rootfs" sh -c "$burst_loop")
	else
		id=$(podman_ run "${args[@]}" --rootfs "$work/rootfs" sh -c 'while :; do :; done')
	fi
	echo "$name $role $weight $id" >>"$work/containers"
}

# run_case CORE BIN_DIR LOAD CASE: one run in its own directory (runN, `run` says which), analyzed
# at once.
run_case() {
	local core=$1 load=$3 kase=$4 measure=$steady_seconds i start_ms end_ms offset
	work=$top/run$((${#done_runs[@]} + 1))
	bin=$2
	mkdir -p "$work"
	echo "$core $load $kase" >"$work/run"
	gpuplex_start_service 234 "Fake GPU (bench-bursts)" 80Gi 'slice = "200ms"'
	gpuplex_podman_setup "$work/podman" hooks
	gpuplex_busybox_rootfs "$work/rootfs" sh sleep true
	mkdir -p "$work/rootfs/log"
	: >"$work/containers"
	for i in 1 2 3; do start "steady$i" steady "$i"; done
	if [ "$kase" = bursty ]; then
		for i in 1 2 3; do start "burst$i" bursty 1 "$((seed * 10 + i))"; done
		measure=$seconds
	fi
	sleep "$warmup"
	offset=$(python3 "$analyzer" offset)
	start_ms=$(date +%s%3N)
	sleep "$measure"
	end_ms=$(date +%s%3N)
	echo "$start_ms $end_ms $offset" >"$work/window"
	# A few seconds more, so that bursts begun near the end finish, log and get their window.
	sleep "$grace"
	ctl timeline --since 10m -o json >"$work/events.json" ||
		die "gpuplexctl timeline -o json failed ($after/gpuplexctl must be the after one)"
	ctl status -o json >"$work/status.json"
	stop_run
	python3 "$analyzer" analyze "$work"
	done_runs+=("$work/result.json")
}

done_runs=()
cores=()
[ -z "$before" ] || cores+=("before:$before")
cores+=("after:$after")
loads=(idle)
[ "$stress" = 0 ] || loads+=(stressed)
echo "bench-bursts: ${#cores[@]} core(s) (${cores[*]}), loads: ${loads[*]}; steady ${steady_seconds}s,"
echo "bursty ${seconds}s measured after ${warmup}s of warm-up; one fake GPU, slice 200ms, seed $seed"
echo "(a run per row as it ends; the whole table at the end)"
for load in "${loads[@]}"; do
	[ "$load" = idle ] || start_stress
	for kase in steady bursty; do
		for core in "${cores[@]}"; do run_case "${core%%:*}" "${core#*:}" "$load" "$kase"; done
	done
	stop_stress
done

echo
echo "Shares and busy are % of the measured window, from the node service's window events; a"
echo "bursty container's share counts its windows while it wanted the GPU (intended start to end)."
echo "Fair: ∫ weight / Σ weights of those wanting. Waits: a burst's intended start to its first window."
echo
python3 "$analyzer" table "$results" "${done_runs[@]}"
echo
echo "results: $results; wall time ${SECONDS}s"
