# 4b. gpuplex through NRI, with runc's own shim: the tests that play the kubelet over the CRI
# against a containerd 1.7 with NRI enabled (each starts its own; here nothing may skip): an
# annotated pod and a DRA claim's pod get their vGPUs under io.containerd.runc.v2 and take
# turns, the plugin killed and started again mid-run, containerd restarted, a refusal. Then the
# package's gpuplex-nri.service on the host's containerd under systemd: it registers, comes back
# when containerd restarts and when it is killed, and its journal has no error.
. "$(dirname "$0")/lib.sh"

config=/etc/containerd/config.toml
cleanup() {
	systemctl disable --now gpuplex-nri.service >/dev/null 2>&1 || true
	if [ -f "$var/containerd-config.orig" ]; then
		mv "$var/containerd-config.orig" "$config"
		systemctl restart containerd.service || true
	fi
}
trap cleanup EXIT

ran=0
while IFS=$'\t' read -r package kind name dir exe; do
	[ "$package/$kind/$name" = gpuplex-nri/test/containerd ] || continue
	echo "== $package $name"
	ran=$((ran + 1))
	(cd "$dir" && "$exe" --test-threads=1 --nocapture 2>&1) | tee "$var/$name.out" ||
		fail "gpuplex-nri's containerd tests failed on containerd 1.7"
	! grep -q '^SKIPPED' "$var/$name.out" || fail "gpuplex-nri's containerd tests skipped on containerd 1.7"
done <"$run/tests.tsv"
[ "$ran" = 1 ] || fail "found $ran of the 1 test executable (gpuplex-nri's containerd) in $run/tests.tsv"

echo "NRI enabled in $config; systemctl enable --now gpuplex-nri"
[ -f "$config" ] && cp "$config" "$var/containerd-config.orig" || : >"$var/containerd-config.orig"
grep -q 'io.containerd.nri.v1.nri' "$config" 2>/dev/null &&
	fail "$config has an NRI table already; this check writes its own"
cat >>"$config" <<'TOML'

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "/var/run/nri/nri.sock"
TOML
systemctl restart containerd.service
wait_for 20 test -S /var/run/nri/nri.sock || fail "containerd made no NRI socket: $(journalctl -u containerd -n 20 --no-pager)"
[ "$(systemctl is-enabled gpuplex-nri.service)" = disabled ] ||
	fail "the package left gpuplex-nri.service $(systemctl is-enabled gpuplex-nri.service); it is the operator's to enable"
systemctl enable --now gpuplex-nri.service
configured() { [ "$(journalctl -u gpuplex-nri.service -q --no-pager | grep -c 'configured by')" -ge "$1" ]; }
wait_for 20 configured 1 || fail "gpuplex-nri was not configured by containerd: $(journalctl -u gpuplex-nri -n 20 --no-pager)"
echo "systemctl restart containerd: the plugin registers again"
systemctl restart containerd.service
wait_for 30 configured 2 || fail "gpuplex-nri did not come back after containerd's restart: $(journalctl -u gpuplex-nri -n 20 --no-pager)"
echo "kill -9 of the plugin: systemd starts it again and it registers"
kill -9 "$(systemctl show -P MainPID gpuplex-nri.service)"
wait_for 30 configured 3 || fail "gpuplex-nri did not come back after kill -9: $(journalctl -u gpuplex-nri -n 20 --no-pager)"
errors=$(journalctl -u gpuplex-nri.service -p err -q --no-pager)
[ -z "$errors" ] || fail "gpuplex-nri's journal has errors: $errors"
journalctl -u gpuplex-nri.service -q --no-pager | tail -n 4
echo "gpuplex-nri.service registered with the host's containerd 3 times (start, containerd restart, kill -9)"
