# 1. (end) apt remove with a container frozen leaves it thawed and the service stopped; apt purge
# leaves nothing of gpuplex.
. "$(dirname "$0")/lib.sh"

cleanup() { podman rm -f -t 0 held1 held2 >/dev/null 2>&1 || true; }
trap cleanup EXIT
service_active || fail "gpuplex.service is not active before the removal"
busy_podman held1 1 4Gi --annotation 'gpuplex.io/gpu-model=Fake A100'
busy_podman held2 1 4Gi --annotation 'gpuplex.io/gpu-model=Fake A100'
a=$(podman_cgroup held1) b=$(podman_cgroup held2)
wait_for 20 some_frozen "$a" "$b" || fail "neither container was ever frozen"

echo "apt-get remove gpuplex, with one of two containers frozen"
DEBIAN_FRONTEND=noninteractive apt-get remove -y -q gpuplex
all_thawed "$a" "$b" || fail "a container is still frozen after apt remove: held1 $(frozen "$a"), held2 $(frozen "$b")"
systemctl is-active -q gpuplex.service && fail "gpuplex.service is still active after apt remove"
systemctl is-active -q gpuplex.socket && fail "gpuplex.socket is still active after apt remove"
pgrep -f 'containerd-shim-gpuplex-v1 serve' && fail "a node service still runs after apt remove"
wait_for 5 sh -c '! pgrep -x gpuplex-watchdo' || fail "a watchdog still runs after apt remove"
sleep 1
all_thawed "$a" "$b" || fail "a container was frozen again after apt remove"
[ -f "$conffile" ] || fail "apt remove took the conffile $conffile"

cleanup
echo "apt-get purge gpuplex"
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q gpuplex
left=""
for p in /etc/gpuplex /run/gpuplex /usr/lib/systemd/system/gpuplex.service \
	/usr/lib/systemd/system/gpuplex.socket /etc/systemd/system/sockets.target.wants/gpuplex.socket \
	/etc/systemd/system/multi-user.target.wants/gpuplex.service /usr/share/gpuplex \
	/usr/share/containers/oci/hooks.d/gpuplex-precreate.json /usr/bin/containerd-shim-gpuplex-v1 \
	/usr/bin/gpuplexctl /usr/bin/gpuplex-hook; do
	[ -e "$p" ] && left="$left $p"
done
[ -z "$left" ] || fail "apt purge left:$left"
[ "$(systemctl show -P LoadState gpuplex.service)" = not-found ] ||
	fail "systemd still knows gpuplex.service after the purge: $(systemctl show -P LoadState gpuplex.service)"
echo "removed: containers thawed, service stopped; purged: nothing left"
