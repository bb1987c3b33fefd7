# 3. containerd 1.7 (the distribution's, run by systemd) after `gpuplexctl install containerd`:
# two `ctr run --runtime io.containerd.gpuplex.v1` containers on one fake GPU take turns, with
# runc's systemd cgroup driver (SystemdCgroup = true: a scope under system.slice) and with
# cgroupfs (false: /default/ID); systemd neither undoes a freeze (daemon-reload) nor leaves one
# behind when it stops a frozen container's scope; and containers started through the shim while
# `systemctl restart gpuplex` runs wait for the unit's next service (gpuplex.socket keeps the
# socket listening) instead of starting one of their own outside the unit.
. "$(dirname "$0")/lib.sh"

ctr_() { ctr --timeout 60s "$@"; }
ids=(sd1 sd2 fs1 fs2 r1 r2 r3)
cleanup() {
	local id
	for id in "${ids[@]}"; do
		ctr_ task kill -s KILL "$id" >/dev/null 2>&1 || true
	done
	sleep 0.5
	for id in "${ids[@]}"; do
		ctr_ task rm -f "$id" >/dev/null 2>&1 || true
		ctr_ container rm "$id" >/dev/null 2>&1 || true
	done
	if [ -f "$var/conffile.orig" ]; then
		mv "$var/conffile.orig" "$conffile"
		systemctl restart gpuplex.service || true
	fi
}
trap cleanup EXIT
service_active || fail "gpuplex.service is not active (10-package-install failed?)"

echo "gpuplexctl install containerd; systemctl restart containerd"
ctl install containerd
systemctl restart containerd.service
wait_for 20 ctr_ version || fail "containerd does not answer after its restart"
ctr_ plugins ls | grep -q 'io.containerd.grpc.v1.*cri.*ok' || fail "containerd's CRI plugin did not load with gpuplex's entry: $(ctr_ plugins ls | grep cri)"

# SystemdCgroup = true, as containerd's runtime options file says it (CRI's config_path form).
printf 'SystemdCgroup = true\n' >"$var/systemd-cgroup.toml"
busy_ctr() { # ID [CTR RUN FLAGS]
	local id=$1
	shift
	ctr_ run -d --rootfs --runtime io.containerd.gpuplex.v1 --env PATH=/bin \
		--annotation gpuplex.io/gpu-memory=4Gi --annotation 'gpuplex.io/gpu-model=Fake A100' \
		"$@" "$(rootfs)" "$id" sh -c 'while :; do :; done' >/dev/null
}
for id in sd1 sd2; do
	busy_ctr "$id" --runtime-config-path "$var/systemd-cgroup.toml" --cgroup "system.slice:gpuplex-hosts:$id"
done
sd1=/sys/fs/cgroup/system.slice/gpuplex-hosts-sd1.scope sd2=/sys/fs/cgroup/system.slice/gpuplex-hosts-sd2.scope
for c in "$sd1" "$sd2"; do [ -f "$c/cgroup.freeze" ] || fail "no systemd scope $c: $(ls /sys/fs/cgroup/system.slice)"; done
[ "$(systemctl show -P ActiveState gpuplex-hosts-sd1.scope)" = active ] || fail "systemd does not know gpuplex-hosts-sd1.scope"
took_turns 20 "$sd1" "$sd2" || fail "the SystemdCgroup = true containers did not take turns within 20 s"
echo "SystemdCgroup = true: scopes under system.slice take turns"

for id in fs1 fs2; do busy_ctr "$id"; done
fs1=/sys/fs/cgroup/default/fs1 fs2=/sys/fs/cgroup/default/fs2
for c in "$fs1" "$fs2"; do [ -f "$c/cgroup.freeze" ] || fail "no cgroupfs cgroup $c: $(ls /sys/fs/cgroup/default 2>&1)"; done
took_turns 30 "$sd1" "$sd2" "$fs1" "$fs2" || fail "the four containers did not take turns within 30 s"
echo "SystemdCgroup = false: /default/ID cgroups take turns with the others"
for id in fs1 fs2; do ctr_ task kill -s KILL "$id"; done

# Windows of 30 s: one scope holds the GPU, the other stays frozen while systemd reloads. Every
# container has work (`always`): under emulation the reload can take the CPUs from the holder's
# busy loop for a sample, which the cpu source reads as its work ending, and the window would pass
# on for that reason rather than systemd's.
cp "$conffile" "$var/conffile.orig"
sed -i -e 's/^slice = .*/slice = "30s"/' -e 's/^activity = .*/activity = "always"/' "$conffile"
grep -q '^activity = "always"' "$conffile" || fail "could not set activity = \"always\" in $conffile"
systemctl restart gpuplex.service
wait_for 20 test -S "$socket" || fail "the service did not come back after its restart"
wait_for 20 some_frozen "$sd1" "$sd2" || fail "neither scope was frozen again after the service's restart"
if [ "$(frozen "$sd1")" = 1 ]; then held=sd1 cold=$sd1 warm=$sd2; else held=sd2 cold=$sd2 warm=$sd1; fi
systemctl daemon-reload
systemctl set-property --runtime "gpuplex-hosts-$held.scope" CPUWeight=50
sleep 2
[ "$(frozen "$cold")" = 1 ] && [ "$(cat "$cold/cgroup.freeze")" = 1 ] || fail "systemd undid the freeze of $cold (daemon-reload, set-property)"
[ "$(frozen "$warm")" = 0 ] || fail "$warm is frozen although it holds the window"

echo "systemctl stop gpuplex-hosts-$held.scope while it is frozen"
systemctl stop "gpuplex-hosts-$held.scope"
wait_for 10 sh -c "! test -d $cold" || fail "the frozen scope's cgroup $cold is still there after systemctl stop"
wait_for 10 sh -c "ctr --timeout 5s task ls | grep -w $held | grep -qv RUNNING" ||
	fail "ctr still lists $held running after its scope stopped: $(ctr_ task ls)"
# Alone now: the other is never frozen, and gpuplex let the stopped one go.
sleep 1
[ "$(frozen "$warm")" = 0 ] || fail "$warm is frozen although it is alone on its GPU"
frozen_left=$(grep -l '^frozen 1' /sys/fs/cgroup/system.slice/*/cgroup.events 2>/dev/null || true)
[ -z "$frozen_left" ] || fail "frozen cgroups left behind: $frozen_left"
ctl status
echo "systemd kept gpuplex's freeze and stopped a frozen scope cleanly"

# Restarts while containers start: each `ctr run` that needs the node service during a restart
# must be served by the unit's next service; a service of the shim's own would run outside the
# unit, hold the node lock and make the unit fail.
echo "systemctl restart gpuplex.service three times while three containers start through the shim"
for id in r1 r2 r3; do
	busy_ctr "$id" &
	systemctl restart gpuplex.service
	wait $! || fail "ctr run $id failed while the service restarted"
done
wait_for 20 service_active || fail "gpuplex.service is not active after the restarts: $(systemctl status gpuplex --no-pager | tail -n 5)"
services=$(pgrep -f 'containerd-shim-gpuplex-v1 serve' | tr '\n' ' ')
[ "$services" = "$(main_pid) " ] || fail "node services running: $services; the unit's is $(main_pid) (a shim started one of its own)"
for id in r1 r2 r3; do
	wait_for 20 sh -c "gpuplexctl status -o json | jq -e '.containers[] | select(.id == \"$id\")' >/dev/null" ||
		fail "$id has no vGPU after the restarts: $(ctl status)"
done
journalctl -u gpuplex.service -q --no-pager | grep -q 'passed by systemd' || fail "the service did not get its socket from gpuplex.socket"
echo "every container started during the restarts has its vGPU from the unit's service (pid $(main_pid))"
