# 7. The node service's own tests that need root and cgroups (node/tests) and the cgroup layer's
# (cgroup/: the freezer against the kernel, the admission checks among its unit tests), run here
# on pure cgroup v2 under systemd: the executables cargo built on the host (run/tests.tsv).
. "$(dirname "$0")/lib.sh"

# The installed service would share the CPUs with these tests' own services: stopped meanwhile.
systemctl stop gpuplex.service 2>/dev/null || true
trap 'systemctl start gpuplex.service 2>/dev/null || true' EXIT
failed="" ran=0
while IFS=$'\t' read -r package kind name dir exe; do
	case "$package/$kind" in
	gpuplex-node/test | gpuplex-cgroup/test | gpuplex-cgroup/lib) ;;
	*) continue ;;
	esac
	echo "== $package $kind $name"
	ran=$((ran + 1))
	(cd "$dir" && "$exe" 2>&1) || failed="$failed $package/$name"
done <"$run/tests.tsv"
[ "$ran" -gt 0 ] || fail "no test executable of gpuplex-node or gpuplex-cgroup in $run/tests.tsv"
[ -z "$failed" ] || fail "failed on cgroup v2 under systemd:$failed"
echo "$ran test executables passed"
