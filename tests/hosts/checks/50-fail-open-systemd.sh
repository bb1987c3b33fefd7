# 5. Fail-open under systemd, with two busy containers on one GPU (one frozen at any moment):
# kill -9 of the service's main pid, `systemctl stop`, and `systemctl kill --signal=SIGKILL`
# (service and watchdog in one unit) each leave every container thawed within 1 s of the death
# (a stop: of the command); systemd
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

# journal_since: the unit's journal since $t0, its times in seconds since boot.
journal_since() {
	journalctl -u gpuplex.service -o short-monotonic --no-pager -q --since "@${t0:0:-6}.${t0: -6}"
}

# thawed_within MS WHAT [KILLED]: every container thawed within MS milliseconds of the service's
# death, and still after. The death is $t0, or, given KILLED (a pattern of systemd's journal
# line for its kill), that line's time: `systemctl kill` first asks systemd over D-Bus, and how
# long systemctl takes to start (a tenth of a second and more in an emulated VM) is not the
# service's time to thaw.
thawed_within() {
	wait_for 5 all_thawed "$a" "$b" || fail "$2: still frozen 5 s later (open1 $(frozen "$a"), open2 $(frozen "$b"))"
	local took up killed=""
	took=$(ms_since "$t0")
	read -r up _ </proc/uptime
	echo "$2: all thawed, seen $took ms after the command; the unit's journal since (seconds since boot; the command at $up0, thawed seen at $up):"
	journal_since | tail -n 8 | sed 's/^/  /'
	if [ -n "${3:-}" ]; then
		wait_for 5 sh -c "journalctl -u gpuplex.service -q --no-pager --since '@${t0:0:-6}.${t0: -6}' | grep -q '$3'" ||
			fail "$2: no line of systemd's kill ($3) in the unit's journal"
		# Every stage reads all its input: none exits early, so none dies of SIGPIPE (pipefail).
		killed=$(journal_since | grep "$3" | sed -n '1s/^\[ *\([0-9.]*\)\].*/\1/p')
		took=$(awk -v from="$killed" -v to="$up" 'BEGIN { printf "%d", (to - from) * 1000 }')
		echo "$2: all thawed, seen $took ms after systemd's kill"
	fi
	[ "$took" -le "$1" ] || fail "$2: thawed only after $took ms"
}
windowed_again() {
	wait_for 30 service_active || fail "$1: systemd did not start the service again: $(systemctl status gpuplex --no-pager | tail -n 5)"
	took_turns 30 "$a" "$b" || fail "$1: the containers are not windowed again"
	echo "$1: service active again (pid $(main_pid)), containers windowed"
}

wait_for 20 some_frozen "$a" "$b" || fail "neither container was ever frozen"
pid=$(main_pid)
t0=${EPOCHREALTIME/./} && read -r up0 _ </proc/uptime
kill -9 "$pid"
thawed_within 1000 "kill -9 of the main pid $pid"
windowed_again "after kill -9"

wait_for 20 some_frozen "$a" "$b" || fail "neither container frozen before systemctl stop"
t0=${EPOCHREALTIME/./} && read -r up0 _ </proc/uptime
systemctl stop gpuplex.service
# No bound but systemctl's own: it returns once the stop job is done, the service's thaws in it.
thawed_within 5000 "systemctl stop"
wait_for 10 sh -c '! pgrep -x gpuplex-watchdo' || fail "the watchdog is still running after systemctl stop"
systemctl start gpuplex.service
windowed_again "after systemctl start"

wait_for 20 some_frozen "$a" "$b" || fail "neither container frozen before systemctl kill"
t0=${EPOCHREALTIME/./} && read -r up0 _ </proc/uptime
systemctl kill --signal=SIGKILL gpuplex.service
thawed_within 1000 "systemctl kill --signal=SIGKILL (service and watchdog)" 'Sent signal SIGKILL to main process\|Killed unit cgroup with SIGKILL'
windowed_again "after systemctl kill"
errors=$(journalctl -u gpuplex.service -p err -q --no-pager --since "-5min" | grep -v 'Main process exited\|Failed with result' || true)
echo "journal errors (expected: none but systemd's own about the kills): ${errors:-none}"
