#!/usr/bin/env bash
# Runs inside the test host (Debian 13, systemd, cgroup v2), started by the image's
# gpuplex-host-runner.service with the repository mounted at its host path: each check of
# tests/hosts/checks/ in order (only those matching gpuplex.checks=REGEX from the kernel command
# line, when given), its output in target/hosts/run/logs/NAME.log, one line per check in
# target/hosts/run/results ("ok NAME (Ns)" or "FAIL NAME (Ns): its last line"), then "done".
set -u

repo=$(cd "$(dirname "$0")/../.." && pwd)
run=$repo/target/hosts/run
export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export GPUPLEX_HOSTS_REPO=$repo GPUPLEX_HOSTS_RUN=$run
results=$run/results
filter=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^gpuplex\.checks=//p' | tail -n 1)

say() {
	echo "$*" >>"$results"
	echo "$*"
}

version() { "$@" 2>/dev/null | head -n 1; }
say "guest up after $(cut -d' ' -f1 /proc/uptime) s: Linux $(uname -r); $(version systemctl --version);" \
	"/sys/fs/cgroup is $(stat -fc %T /sys/fs/cgroup); $(version containerd --version | cut -d' ' -f1,3);" \
	"runc $(version runc --version | cut -d' ' -f3); $(version crun --version); $(version podman --version)"

for check in "$repo"/tests/hosts/checks/[0-9]*.sh; do
	name=$(basename "$check" .sh)
	if [ -n "$filter" ] && ! [[ $name =~ $filter ]]; then
		continue
	fi
	log=$run/logs/$name.log
	started=$(date +%s)
	if (cd /tmp && timeout 900 bash "$check") >"$log" 2>&1; then
		say "ok   $name ($(($(date +%s) - started)) s)"
	else
		say "FAIL $name ($(($(date +%s) - started)) s): $(grep -v '^\s*$' "$log" | tail -n 1)"
	fi
done
say "done"
