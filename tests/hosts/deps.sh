#!/usr/bin/env bash
# What make test-hosts needs on the machine that boots the test host: qemu-system-x86_64, qemu-img,
# debootstrap and jq, from Debian, installed when missing (root). On Debian 12 machines whose
# qemu-utils came from bookworm-backports (these do), bookworm's qemu-system-x86 cannot go
# beside it: then both come from bookworm-backports, whose source is added for that.
set -euo pipefail

missing=""
for pair in qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils debootstrap:debootstrap jq:jq; do
	PATH=$PATH:/usr/sbin:/sbin command -v "${pair%%:*}" >/dev/null || missing="$missing ${pair#*:}"
done
[ -n "$missing" ] || exit 0
[ "$(id -u)" = 0 ] || { echo "make test-hosts needs$missing: apt-get install$missing (as root)" >&2; exit 1; }

# --no-remove: apt-get -y would otherwise make room for bookworm's qemu-system-x86 by removing the
# qemu-utils from bookworm-backports (and qemu-img with it), instead of failing over to backports.
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --no-remove "$@" >/dev/null; }
echo "installing:$missing"
if install $missing 2>/dev/null || { apt-get update -q >/dev/null && install $missing 2>/dev/null; }; then
	exit 0
fi
. /etc/os-release
if [ "${VERSION_CODENAME:-}" != bookworm ]; then
	echo "could not install$missing with apt-get" >&2
	exit 1
fi
if ! apt-cache policy | grep -q 'bookworm-backports'; then
	echo "adding Debian's bookworm-backports to apt's sources (qemu-utils on this machine is from there)"
	cat >/etc/apt/sources.list.d/gpuplex-bookworm-backports.sources <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
	apt-get update -q >/dev/null
fi
install -t bookworm-backports $missing
