#!/usr/bin/env bash
# The test host's disk image: Debian 13 (trixie) from Debian's packages with debootstrap, systemd
# as PID 1 and pure cgroup v2 (trixie's defaults), containerd 1.7, runc, crun and podman 5 as
# trixie ships them. Written under $1 (default target/hosts/image): disk.raw (ext4, sparse),
# vmlinuz, initrd.img, and recipe.sha256, the hash of this file. Nothing is done when recipe.sha256
# matches: the image is rebuilt only when this recipe changes.
#
# The image holds no gpuplex: each boot gets the repository over virtio-9p (tests/hosts/run.sh),
# and the guest's one unit of ours, gpuplex-host-runner.service, mounts it at the path the kernel
# command line names (gpuplex.share=PATH), runs gpuplex.run=SCRIPT from it and powers off.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/target/hosts/image}
mirror=${GPUPLEX_HOSTS_MIRROR:-http://deb.debian.org/debian}
suite=trixie
size=8G
packages=systemd-sysv,udev,dbus,kmod,linux-image-amd64,e2fsprogs,containerd,runc,crun,podman,conmon,busybox-static,iproute2,procps,jq,python3,ca-certificates

want=$(sha256sum "$0" | cut -d' ' -f1)
if [ "$(cat "$out/recipe.sha256" 2>/dev/null)" = "$want" ] && [ -f "$out/disk.raw" ]; then
	echo "hosts image: up to date ($out)"
	exit 0
fi
[ "$(id -u)" = 0 ] || { echo "hosts image: debootstrap needs root" >&2; exit 1; }
for tool in debootstrap mkfs.ext4; do
	command -v "$tool" >/dev/null || { echo "hosts image: $tool is missing (make test-hosts installs it)" >&2; exit 1; }
done

work=$out.new
root=$work/rootfs
rm -rf "$work"
mkdir -p "$work"
cleanup() {
	for m in proc sys dev/pts dev; do umount "$root/$m" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT

started=$(date +%s)
echo "hosts image: debootstrap $suite ($packages)"
debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
	tail -20 "$work/debootstrap.log" >&2
	echo "hosts image: debootstrap failed (log above)" >&2
	exit 1
}

# The guest's own configuration.
echo gpuplex-host >"$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 gpuplex-host\n' >"$root/etc/hosts"
printf '/dev/vda / ext4 rw,relatime 0 0\n' >"$root/etc/fstab"
chroot "$root" passwd -d root >/dev/null
# No network is configured: nothing but the 9p share crosses between host and guest.
cat >"$root/usr/local/sbin/gpuplex-host-runner" <<'EOF'
#!/bin/sh
# Mounts the host's repository at the path it has on the host, runs the script the kernel
# command line names, and powers off. What the script prints goes to the console.
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p" | tail -n 1; }
share=$(arg gpuplex.share)
script=$(arg gpuplex.run)
if [ -n "$share" ] && [ -n "$script" ]; then
	mkdir -p "$share"
	# The virtio 9p device can probe after this unit starts (seen under TCG: "special device
	# repo does not exist"): its transport is loaded first, and the mount tried for a minute.
	modprobe 9pnet_virtio 2>/dev/null || true
	mounted=no
	for _ in $(seq 60); do
		if mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose repo "$share" 2>/dev/null; then
			mounted=yes
			break
		fi
		sleep 1
	done
	if [ "$mounted" = yes ]; then
		/bin/bash "$share/$script"
		echo "gpuplex-host-runner: $script exited $?"
	else
		echo "gpuplex-host-runner: could not mount the repository at $share within 60 s (virtio 9p tag repo)"
	fi
	systemctl poweroff --no-block
fi
EOF
chmod 0755 "$root/usr/local/sbin/gpuplex-host-runner"
cat >"$root/etc/systemd/system/gpuplex-host-runner.service" <<'EOF'
[Unit]
Description=gpuplex host suite runner (the repository over 9p)
After=multi-user.target containerd.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/gpuplex-host-runner
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
EOF
chroot "$root" systemctl enable gpuplex-host-runner.service >/dev/null 2>&1
# The console is the runner's; no login prompt is needed on it.
chroot "$root" systemctl mask serial-getty@ttyS0.service getty@tty1.service >/dev/null 2>&1
chroot "$root" apt-get clean

cp -L "$root/vmlinuz" "$work/vmlinuz"
cp -L "$root/initrd.img" "$work/initrd.img"
echo "hosts image: mkfs.ext4 -d ($size, sparse)"
mkfs.ext4 -q -F -L gpuplex-host -d "$root" "$work/disk.raw" "$size"
for m in proc sys dev/pts dev; do umount "$root/$m" 2>/dev/null || true; done
rm -rf "$root"
echo "$want" >"$work/recipe.sha256"
rm -rf "$out"
mv "$work" "$out"
trap - EXIT
echo "hosts image: built in $(($(date +%s) - started)) s ($(du -sh "$out/disk.raw" | cut -f1) used)"
