# 2. podman 5 with the installed hooks (podman's default hooks directory): make demo's three
# containers (weights 1, 2, 3) take turns on fake GPU 0 by cgroup.freeze, each sees only its
# GPU's node, and their own CPU time (the cgroup's cpu.stat) is shared within 3 points of 1:2:3.
. "$(dirname "$0")/lib.sh"

measure=${HOSTS_SHARE_SECONDS:-40}
cleanup() { podman rm -f -t 0 weight1 weight2 weight3 >/dev/null 2>&1 || true; }
trap cleanup EXIT
service_active || fail "gpuplex.service is not active (10-package-install failed?)"

# What one container sees: its GPU's node (allowed: ENXIO, no driver), not the other's.
seen=$(podman run --rm --network none --annotation gpuplex.io/gpu-memory=1Gi \
	--annotation 'gpuplex.io/gpu-model=Fake A100' --rootfs "$(rootfs)" \
	sh -c 'ls /dev; cat /dev/nvidia0 2>&1; echo CUDA=$CUDA_VISIBLE_DEVICES; cat /run/gpuplex/vgpu.json' 2>&1) ||
	fail "podman run with a vGPU failed: $(oneline "$seen")"
echo "$seen"
grep -q "/dev/nvidia0': No such device or address" <<<"$seen" || fail "the container cannot open its GPU's node (want ENXIO): $(oneline "$seen")"
! grep -qw nvidia1 <<<"$seen" || fail "the container sees the other GPU's node: $(oneline "$seen")"
grep -q 'CUDA=GPU-fake-0$' <<<"$seen" || fail "CUDA_VISIBLE_DEVICES is not GPU-fake-0: $(oneline "$seen")"

for w in 1 2 3; do
	busy_podman "weight$w" "$w" 8Gi --annotation 'gpuplex.io/gpu-model=Fake A100'
done
cgroups=()
for w in 1 2 3; do
	c=$(podman_cgroup "weight$w")
	[ -f "$c/cgroup.freeze" ] || fail "weight$w's cgroup $c has no cgroup.freeze"
	echo "weight$w: $c"
	cgroups+=("$c")
done
case ${cgroups[0]} in
/sys/fs/cgroup/machine.slice/libpod-*.scope | /sys/fs/cgroup/machine.slice/libpod-*.scope/*) ;;
*) fail "podman's container is not in a systemd scope under machine.slice: ${cgroups[0]}" ;;
esac
[ "$(ctl status -o json | jq '[.containers[] | select(.gpus == [0])] | length')" = 3 ] ||
	fail "the three containers are not all bound to GPU 0: $(oneline "$(ctl status)")"
took_turns 20 "${cgroups[@]}" || fail "the three containers did not take turns by cgroup.freeze within 20 s"

# Their own CPU time over $measure seconds, after the first windows.
sleep 2
before=()
for c in "${cgroups[@]}"; do before+=("$(cpu_usec "$c")"); done
sleep "$measure"
used=()
for i in 0 1 2; do used+=($(($(cpu_usec "${cgroups[$i]}") - before[i]))); done
total=$((used[0] + used[1] + used[2]))
ctl status
report=""
worst=0
for i in 0 1 2; do
	share=$((used[i] * 1000 / total)) # per mille
	want=$(((i + 1) * 1000 / 6))
	off=$((share > want ? share - want : want - share))
	[ "$off" -gt "$worst" ] && worst=$off
	report="$report weight$((i + 1)) $((share / 10)).$((share % 10))% (want $((want / 10)).$((want % 10))%)"
done
echo "CPU time shares over ${measure} s:$report; busy $((total / 10000 / measure))% of one CPU"
[ "$worst" -le 30 ] || fail "shares off 1:2:3 by more than 3 points:$report"
