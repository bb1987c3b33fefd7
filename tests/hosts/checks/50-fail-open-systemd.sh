# 5. Fail-open under systemd, with two busy containers on one GPU (one frozen at any moment):
# kill -9 of the service's main pid, `systemctl stop`, and `systemctl kill --signal=SIGKILL`
# (service and watchdog in one unit) each leave every container thawed within 1 s; systemd
# restarts the service after a kill, and the containers are windowed again.
. "$(dirname "$0")/lib.sh"

cleanup() {
	podman rm -f -t 0 open1 open2 >/dev/null 2>&1 || true
	systemctl start gpuplex.service || true
}
trap cleanup EXIT
service_active || fail "gpuplex.service is not active (10-package-install failed?)"
busy_podman open1 1 4Gi --annotation 'gpuplex.io/gpu-model=Fake A100'
busy_podman open2 1 4Gi --annotation 'gpuplex.io/gpu-model=Fake A100'
a=$(podman_cgroup open1) b=$(podman_cgroup open2)

# thawed_within MS WHAT: every container thawed within MS milliseconds of $t0, and still after.
thawed_within() {
	wait_for 5 all_thawed "$a" "$b" || fail "$2: still frozen 5 s later (open1 $(frozen "$a"), open2 $(frozen "$b"))"
	local took
	took=$(ms_since "$t0")
	[ "$took" -le "$1" ] || fail "$2: thawed only after $took ms"
	echo "$2: all thawed, $took ms"
}
windowed_again() {
	wait_for 30 service_active || fail "$1: systemd did not start the service again: $(systemctl status gpuplex --no-pager | tail -n 5)"
	took_turns 30 "$a" "$b" || fail "$1: the containers are not windowed again"
	echo "$1: service active again (pid $(main_pid)), containers windowed"
}

wait_for 20 some_frozen "$a" "$b" || fail "neither container was ever frozen"
pid=$(main_pid)
t0=${EPOCHREALTIME/./}
kill -9 "$pid"
thawed_within 1000 "kill -9 of the main pid $pid"
windowed_again "after kill -9"

wait_for 20 some_frozen "$a" "$b" || fail "neither container frozen before systemctl stop"
t0=${EPOCHREALTIME/./}
systemctl stop gpuplex.service
# No bound but systemctl's own: it returns once the stop job is done, the service's thaws in it.
thawed_within 5000 "systemctl stop"
wait_for 10 sh -c '! pgrep -x gpuplex-watchdo' || fail "the watchdog is still running after systemctl stop"
systemctl start gpuplex.service
windowed_again "after systemctl start"

wait_for 20 some_frozen "$a" "$b" || fail "neither container frozen before systemctl kill"
t0=${EPOCHREALTIME/./}
systemctl kill --signal=SIGKILL gpuplex.service
thawed_within 1000 "systemctl kill --signal=SIGKILL (service and watchdog)"
windowed_again "after systemctl kill"
errors=$(journalctl -u gpuplex.service -p err -q --no-pager --since "-5min" | grep -v 'Main process exited\|Failed with result' || true)
echo "journal errors (expected: none but systemd's own about the kills): ${errors:-none}"
