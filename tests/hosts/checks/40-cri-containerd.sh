# 4. The Kubernetes path on containerd 1.7 and cgroup v2: the tests that play the kubelet over
# CRI, run here on the VM's containerd (each test starts a private one): a DRA claim's CDI
# device named in the container's CRI config and applied by containerd itself (enable_cdi), a
# claim's containers under the shim, device-plugin pods, and annotated pods.
. "$(dirname "$0")/lib.sh"

failed="" ran=0
while IFS=$'\t' read -r package kind name dir exe; do
	case "$package/$kind/$name" in
	gpuplex-dra/test/runtimes | gpuplex-dra/test/device_plugin_cri | gpuplex-integration/test/cri) ;;
	*) continue ;;
	esac
	echo "== $package $name"
	ran=$((ran + 1))
	(cd "$dir" && "$exe" --test-threads=1 --nocapture 2>&1) | tee "$var/$name.out" || failed="$failed $package/$name"
	# Here nothing may skip: this is the machine those tests wait for.
	! grep -q '^SKIPPED' "$var/$name.out" || failed="$failed $package/$name(skipped)"
done <"$run/tests.tsv"
[ "$ran" = 3 ] || fail "found $ran of the 3 test executables in $run/tests.tsv"
[ -z "$failed" ] || fail "failed on containerd 1.7:$failed"
echo "$ran test executables passed"
