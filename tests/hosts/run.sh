#!/usr/bin/env bash
# make test-hosts: the host suite (tests/hosts/checks/) inside a Debian 13 virtual machine with
# systemd as PID 1, pure cgroup v2, containerd 1.7, runc, crun and podman 5, the hosts users run.
#
# 1. the image (tests/hosts/image.sh; cached under target/hosts/image, rebuilt when its recipe
#    changes);
# 2. the Debian package of the built binaries (cargo deb, as tests/tests/package.rs builds it; or
#    HOSTS_DEB=PATH, e.g. make deb's) and the test executables the suite runs inside;
# 3. the VM booted from a copy-on-write layer over the image (the image stays as built), the
#    repository shared with it over virtio-9p at the same path, no network;
# 4. inside, tests/hosts/guest.sh runs each check and writes a line per check to
#    target/hosts/run/results, which this script prints as they come, then the guest powers off.
# Exits 0 only when every check passed. HOSTS_CHECKS=REGEX runs only the checks whose names match.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
hosts=$repo/target/hosts
run=$hosts/run
cargo=${CARGO:-cargo}
limit=${HOSTS_TIMEOUT:-2400}

[ "$(id -u)" = 0 ] || { echo "make test-hosts needs root (debootstrap, and the suite installs packages in the VM)" >&2; exit 1; }
command -v qemu-system-x86_64 >/dev/null || { echo "qemu-system-x86_64 is missing: make test-hosts installs it (make hosts-deps)" >&2; exit 1; }

bash tests/hosts/image.sh "$hosts/image"

rm -rf "$run"
mkdir -p "$run/logs"

# The package, from the debug binaries unless told otherwise: the same package but for them.
if [ -n "${HOSTS_DEB:-}" ]; then
	cp "$HOSTS_DEB" "$run/gpuplex.deb"
else
	$cargo build --workspace --bins --locked
	$cargo deb -p gpuplex-shim --no-build --profile dev --fast --locked --output "$run/deb" >/dev/null 2>"$run/deb.log" ||
		{ cat "$run/deb.log" >&2; exit 1; }
	mv "$run"/deb/gpuplex_*.deb "$run/gpuplex.deb"
fi

# The test executables the guest runs (check 70): package, target kind, target name, the
# package's directory (a test's working directory) and the executable, a line each.
$cargo test --workspace --locked --no-run --message-format=json 2>"$run/tests-build.log" |
	jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test)
		| [(.package_id | capture("#(?<p>[^@]+)@").p), .target.kind[0], .target.name,
		   (.manifest_path | rtrimstr("/Cargo.toml")), .executable] | @tsv' >"$run/tests.tsv" ||
	{ cat "$run/tests-build.log" >&2; exit 1; }

# KVM where it works, else TCG (these machines have /dev/kvm but no VT-x).
accel=tcg cpu=max
if [ -w /dev/kvm ] && grep -qE '\b(vmx|svm)\b' /proc/cpuinfo; then
	accel=kvm cpu=host
fi
qemu-img create -q -f qcow2 -b "$hosts/image/disk.raw" -F raw "$run/disk.qcow2"
: >"$run/results"
args="root=/dev/vda rw console=ttyS0 panic=1 gpuplex.share=$repo gpuplex.run=tests/hosts/guest.sh"
[ -n "${HOSTS_CHECKS:-}" ] && args="$args gpuplex.checks=$HOSTS_CHECKS"

echo "test-hosts: booting Debian 13 ($accel, 2 CPUs, 4 GiB); console in $run/console.log"
started=$(date +%s)
timeout "$limit" qemu-system-x86_64 -accel "$accel" -cpu "$cpu" -smp 2 -m 4096 \
	-nodefaults -display none -no-reboot \
	-serial "file:$run/console.log" \
	-kernel "$hosts/image/vmlinuz" -initrd "$hosts/image/initrd.img" -append "$args" \
	-drive "file=$run/disk.qcow2,if=virtio,format=qcow2,cache=unsafe" \
	-virtfs "local,path=$repo,mount_tag=repo,security_model=none,multidevs=remap" \
	-nic none &
qemu=$!
tail -n +1 --pid="$qemu" -f "$run/results" 2>/dev/null || true
wait "$qemu" && status=0 || status=$?
took=$(($(date +%s) - started))

if [ "$status" = 124 ]; then
	echo "test-hosts: the VM did not finish within ${limit} s (HOSTS_TIMEOUT); console: $run/console.log" >&2
	exit 1
fi
if ! grep -q '^done' "$run/results"; then
	echo "test-hosts: the suite did not finish (qemu exited $status); the console's end:" >&2
	tail -n 30 "$run/console.log" >&2
	exit 1
fi
# A failed check's log ends with what failed (libtest prints its failures last): shown here, so
# that a CI run's output says it.
{ grep '^FAIL ' "$run/results" || true; } | while read -r _ name _; do
	echo "test-hosts: the end of $name's log:"
	tail -n 60 "$run/logs/$name.log" 2>&1 | sed 's/^/  | /' || true
done
passed=$(grep -c '^ok ' "$run/results" || true)
failed=$(grep -c '^FAIL ' "$run/results" || true)
echo "test-hosts: ${took} s from boot to power-off ($accel); logs in $run/logs"
echo "test-hosts: $passed passed, $failed failed"
[ "$failed" = 0 ]
