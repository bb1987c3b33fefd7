# 1. The package under real systemd: apt installs it, enables and starts gpuplex.service (on
# gpuplex.socket's socket) with the operator's conffile (one [[fake_gpu]] of each model), and
# the unit's journal has no error.
. "$(dirname "$0")/lib.sh"

write_conffile
echo "apt-get install ./gpuplex.deb, keeping the operator's conffile"
cp "$run/gpuplex.deb" /tmp/gpuplex.deb
DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o Dpkg::Options::=--force-confold /tmp/gpuplex.deb
[ "$(systemctl is-enabled gpuplex.service)" = enabled ] || fail "gpuplex.service is not enabled after install: $(systemctl is-enabled gpuplex.service)"
wait_for 20 service_active || fail "gpuplex.service is not active after install: $(systemctl is-active gpuplex.service); $(journalctl -u gpuplex -n 5 --no-pager)"
wait_for 20 test -S "$socket" || fail "no node socket at $socket"
[ "$(systemctl is-enabled gpuplex.socket)" = enabled ] || fail "gpuplex.socket is not enabled after install: $(systemctl is-enabled gpuplex.socket)"
[ "$(systemctl is-active gpuplex.socket)" = active ] || fail "gpuplex.socket is not active after install: $(systemctl is-active gpuplex.socket)"
status=$(ctl status -o json)
[ "$(echo "$status" | jq -r '[.gpus[].uuid] | join(",")')" = GPU-fake-0,GPU-fake-1 ] || fail "gpuplexctl status does not show the conffile's two fake GPUs: $status"
# The service and its watchdog run in the unit's cgroup.
cgroup=/sys/fs/cgroup/system.slice/gpuplex.service
grep -qx "$(main_pid)" "$cgroup/cgroup.procs" || fail "the service's main pid is not in $cgroup"
pgrep -x gpuplex-watchdo >/dev/null || fail "no gpuplex-watchdog runs"
errors=$(journalctl -u gpuplex.service -p err -q --no-pager)
[ -z "$errors" ] || fail "the unit's journal has errors: $errors"
journalctl -u gpuplex.service -q --no-pager | tail -n 5
journalctl -u gpuplex.service -q --no-pager | grep -q 'passed by systemd' || fail "the service did not get its socket from gpuplex.socket"
echo "gpuplex.service active (pid $(main_pid)) on gpuplex.socket's socket, both enabled, journal without error"
