#!/usr/bin/env bash
# Stages the build context of gpuplex's node image from binaries already built: no registry and
# no base image, config/image/Containerfile is `FROM scratch` and takes everything from here.
#
#   config/image/stage.sh BIN_DIR STAGE_DIR
#   podman build --tag localhost/gpuplex:0.1.0 --file config/image/Containerfile STAGE_DIR
#
# BIN_DIR    where cargo put the binaries (target/release; target/debug for the test)
# STAGE_DIR  the build context; its rootfs/ is emptied and filled here (under target/, never git)
#
# `make image` does both (PROFILE=debug for the debug binaries); dra/tests/image.rs too.
#
# The staged rootfs: the four binaries in /usr/local/bin; every shared library they link (ldd,
# at the paths it names, the loader included); Debian's static busybox as /bin/busybox with the
# applets the DaemonSet's init container runs (sh, cp, chmod, mv) and a few for debugging.
set -euo pipefail

if [ $# -ne 2 ]; then
	echo "usage: $0 BIN_DIR STAGE_DIR" >&2
	exit 2
fi
bin_dir=$1 stage=$2
binaries="containerd-shim-gpuplex-v1 gpuplex-dra gpuplex-hook gpuplex-nri gpuplexctl"
applets="sh cp chmod mv rm ln ls cat mkdir echo test"

for b in $binaries; do
	if [ ! -x "$bin_dir/$b" ]; then
		echo "$0: $bin_dir/$b is not built (cargo build --workspace --bins)" >&2
		exit 1
	fi
done
if [ ! -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; then
	echo "$0: the image's shell is Debian's static busybox: apt-get install busybox-static" >&2
	exit 1
fi

rootfs=$stage/rootfs
rm -rf "$rootfs"
mkdir -p "$rootfs/usr/local/bin" "$rootfs/bin" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"

# A hard link where the staging directory shares a file system with the build (the debug
# binaries are hundreds of MB), a copy elsewhere.
put() {
	ln -f "$1" "$2" 2>/dev/null || cp "$1" "$2"
}

libraries=""
for b in $binaries; do
	put "$bin_dir/$b" "$rootfs/usr/local/bin/$b"
	# `libX.so => /path (0x...)`, the loader as `/path (0x...)`, the vDSO without a path.
	if ! out=$(ldd "$bin_dir/$b" 2>&1); then
		# A static build (musl) links nothing.
		grep -q "not a dynamic executable" <<<"$out" && continue
		echo "$0: ldd $bin_dir/$b failed: $out" >&2
		exit 1
	fi
	if grep -q "not found" <<<"$out"; then
		echo "$0: $bin_dir/$b links a library this machine does not have:" >&2
		grep "not found" <<<"$out" >&2
		exit 1
	fi
	libraries+=" $(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$out")"
done
for lib in $(tr ' ' '\n' <<<"$libraries" | sort -u); do
	mkdir -p "$rootfs$(dirname "$lib")"
	# The file the link names (libc.so.6 -> libc-2.36.so on some systems), under the link's name.
	cp -L "$lib" "$rootfs$lib"
done

cp /bin/busybox "$rootfs/bin/busybox"
for applet in $applets; do
	ln -s busybox "$rootfs/bin/$applet"
done

echo "staged in $rootfs:"
(cd "$rootfs" && find . -type f -printf '  /%P  %s bytes\n' | sort)
