#!/usr/bin/env bash
# The kubelet's side of the soak (tests/soak/kubelet.py) on its own, for about a minute (root):
# a node service on 4 fake GPUs of 16Gi (set up as soak.sh sets it up), the real gpuplex-dra as
# the DRA driver and as the device plugin, the kubelet and the API server played by
# kubelet-standin (dra/examples/kubelet-standin.rs), pods as podman containers. Claim pods of 1-3
# containers sharing their claim's CDI device on GPUs 0-1, device-plugin allocation pods on
# GPUs 2-3, created and removed at seeded random; once, the DRA driver killed with -9 while a
# prepare waits for its claim, started again and registered, the prepare retried. The node's
# status is checked against the kubelet every second; at the end every pod is removed and the
# node must hold nothing. Exit 0: all held; 1: a mismatch (one line says which); 2: setup.
#
# Run it alone on this 2-core machine: flock /tmp/gpuplex-soak.lock bash tests/soak/kubelet_check.sh
#
# Environment: KUBELET_CHECK_SECONDS (default 60), KUBELET_CHECK_SEED (default random, printed),
# GPUPLEX_BIN_DIR (default target/release; needs containerd-shim-gpuplex-v1, gpuplex-hook,
# gpuplex-dra and examples/kubelet-standin: cargo build --release --locked --bins &&
# cargo build --release --locked -p gpuplex-dra --example kubelet-standin), KUBELET_CHECK_KEEP=1
# keeps the scratch directory.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=${GPUPLEX_BIN_DIR:-$repo/target/release}
seconds=${KUBELET_CHECK_SECONDS:-60}
seed=${KUBELET_CHECK_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
keep=${KUBELET_CHECK_KEEP:-0}
die() { echo "kubelet_check: $*" >&2; exit 2; }

[[ $seconds =~ ^[0-9]+$ && $seconds -ge 20 ]] || die "KUBELET_CHECK_SECONDS must be a whole number of at least 20, not '$seconds'"
[[ $seed =~ ^[0-9]{1,18}$ ]] || die "KUBELET_CHECK_SEED must be a whole number, not '$seed'"
[ "$(id -u)" = 0 ] || die "needs root: it runs podman containers and the node service"
for b in containerd-shim-gpuplex-v1 gpuplex-hook gpuplex-dra examples/kubelet-standin; do
	[ -x "$bin/$b" ] || die "$bin/$b is not built; run: cargo build --release --locked --bins && cargo build --release --locked -p gpuplex-dra --example kubelet-standin"
done
for c in podman runc python3 busybox; do
	command -v "$c" >/dev/null || die "$c is missing (make test-deps installs the runtimes)"
done
echo "kubelet_check: seed $seed, ${seconds}s; replay with KUBELET_CHECK_SEED=$seed"

work=$(mktemp -d /tmp/gpuplex-kubelet-check.XXXXXX)
run_id=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
# shellcheck source=tests/lib.sh
. "$repo/tests/lib.sh"
podman_() { gpuplex_podman "$work/podman" "$@"; }

# Whatever happened: the pods' containers (podman's store is this run's own), the plugins and
# the stand-in (by the pids the module wrote, checked to be theirs), the service (it thaws what
# it froze), this run's CDI specs, the directory.
cleanup() {
	local rc=$? pid name
	podman_ rm -a -f -t 0 >/dev/null 2>&1 || true
	for name in gpuplex-dra kubelet-standin containerd-shim-gpuplex; do
		for pid in $(cat "$work/pids" 2>/dev/null || true) ${service_pid:-}; do
			grep -q "$name" "/proc/$pid/cmdline" 2>/dev/null || continue
			kill -TERM "$pid" 2>/dev/null || true
			for _ in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
			kill -KILL "$pid" 2>/dev/null || true
		done
	done
	rm -f /var/run/cdi/gpuplex.io-vgpu-"$run_id"-*.json /var/run/cdi/.gpuplex.io-vgpu-"$run_id"-*.json.tmp
	# The allocations' specs a killed device plugin left (under the soak's lock, and with no
	# other gpuplex-dra running, they are this run's).
	pgrep -x gpuplex-dra >/dev/null || rm -f /var/run/cdi/gpuplex.io-vgpu-units-gpu-*.json
	if [ "$keep" = 1 ]; then
		echo "kubelet_check: kept $work"
	else
		gpuplex_remove_work
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Four fake GPUs (character devices with the NVIDIA major), the configuration, podman with
# gpuplex's hooks (as the soak runs it), a busybox rootfs; the node service.
mkdir -p "$work/state"
gpuplex_four_gpus_config kcheck 244
gpuplex_podman_setup "$work/podman" hooks
gpuplex_busybox_rootfs "$work/rootfs" sh sleep ls cat
"$bin/containerd-shim-gpuplex-v1" serve --config "$work/gpuplex.toml" >"$work/service.log" 2>&1 &
service_pid=$!
for _ in $(seq 200); do
	[ -S "$work/gpuplex.sock" ] && break
	sleep 0.05
done
[ -S "$work/gpuplex.sock" ] || { tail -5 "$work/service.log" >&2; die "the node service did not start"; }

set +e
python3 -B - "$repo/tests/soak" "$work" "$bin" "$seconds" "$seed" "$run_id" <<'PY'
import json, os, random, sys, threading, time
sys.path.insert(0, sys.argv[1])
import kubelet as kb

soak_dir, work, bin_dir, seconds, seed, run_id = sys.argv[1:7]
seconds, seed = int(seconds), int(seed)
rng = random.Random(seed)
t0 = time.monotonic()
def log(msg):
    print(f"[+{time.monotonic() - t0:5.1f}s] {msg}", flush=True)

pd = f"{work}/podman"
podman = ["env", f"CONTAINERS_CONF={pd}/containers.conf", "podman", "--root", f"{pd}/root",
          "--runroot", f"{pd}/runroot", "--tmpdir", f"{pd}/tmp", "--storage-driver", "vfs"]
socket_path = f"{work}/gpuplex.sock"
k = kb.Kubelet(work=f"{work}/kubelet", bin_dir=bin_dir, node_config=f"{work}/gpuplex.toml",
               node_socket=socket_path, podman=podman, rootfs=f"{work}/rootfs", log=log,
               cpus=0.2, rng=rng, run_id=run_id)
problems = {}  # (kind, key): message, the first time seen
def problem(kind, key, msg):
    if (kind, key) not in problems:
        problems[(kind, key)] = msg
        log(f"MISMATCH {kind}: {msg}")

def status():
    return kb.node_request(socket_path, '{"op":"status"}')["status"]

def pids():
    with open(f"{work}/pids", "w") as f:
        for p in (k.standin and k.standin.proc, k.dra and k.dra.proc, k.dp and k.dp.proc):
            if p is not None:
                f.write(f"{p.pid}\n")

quit = threading.Event()
checks = [0]
def checker():
    while not quit.wait(1.0):
        if k.busy():
            continue
        try:
            for kind, key, msg in k.check(status()):
                problem(kind, key, msg)
            checks[0] += 1
        except (OSError, ValueError, KeyError) as e:
            problem("status-failed", "status", f"status: {e}")

def main():
    k.start()
    pids()
    # The slice the driver published: a device per GPU, its memory.
    got = k.standin.call("slices")
    slices = got.get("slices", {})
    devices = [d["name"] for s in slices.values() for d in s["spec"].get("devices", [])]
    if sorted(devices) != [f"gpu-{i}" for i in range(4)]:
        problem("slice", "slice", f"the published ResourceSlices list {devices}, not gpu-0..gpu-3")
    # Bad input reaches the stand-in and the plugins: each answered, nothing pinned, nothing
    # crashed.
    bad = [("claim", dict(namespace="soak", name="bad", uid=f"{run_id}-0000-4000-8000-000000000bad",
                          gpu="gpu-99", memory="lots")),
           ("prepare", dict(uids=[f"{run_id}-0000-4000-8000-000000000bad"])),
           ("prepare", dict(claims=[{"namespace": "soak", "name": "nope", "uid": "not a uid!"}])),
           ("unprepare", dict(uids=[])), ("allocate", dict(units=["../gpu-0-0"])),
           ("allocate", dict(containers=[])), ("preferred", dict(available=["gpu-9-0"], size=-3)),
           ("claim", dict(object=[1, 2])), ("register", dict(timeout_ms="soon")),
           ("delete_claim", dict(uid=f"{run_id}-0000-4000-8000-000000000bad"))]
    for op, fields in bad:
        got = k.standin.call(op, **fields)
        log(f"bad input {op}: {json.dumps(got)[:160]}")
        if op == "preferred" and got.get("ok") and not got.get("units"):
            continue  # nothing to prefer among units no GPU has
        refused = not got.get("ok") or any(c.get("error") for c in got.get("claims", {}).values())
        if not refused and op not in ("claim", "delete_claim"):  # served, then refused at prepare
            problem("bad-input", op, f"{op} {fields} was not refused: {got}")
        elif "\n" in got.get("error", ""):
            problem("bad-input", op, f"{op}: its error is not one line: {got['error']!r}")
    st = status()
    if st["containers"] or st["reservations"]:
        problem("bad-input", "held", f"bad input left {st['reservations']} reserved")
    for p in (k.standin.proc, k.dra.proc, k.dp.proc):
        if p.poll() is not None:
            problem("bad-input", str(p.args[0]), f"{p.args[0]} exited ({p.returncode}) on bad input")
    threading.Thread(target=checker, daemon=True).start()
    claims, allocs = [], []
    restarted = None
    restart_at = rng.uniform(0.3, 0.5) * seconds
    seen_inside = False
    while time.monotonic() - t0 < seconds - 10:
        if restarted is None and time.monotonic() - t0 > restart_at:
            restarted = k.restart_plugin(mid_prepare=True, gpu=rng.choice([0, 1]),
                                         containers=rng.randint(1, 3))
            pids()
            for c in k.claims:
                if c.state == "running" and c not in claims:
                    claims.append(c)
            continue
        r = rng.random()
        try:
            if r < 0.35 and len(claims) < 5:
                c = k.create_claim_pod(gpu=rng.choice([0, 1]), memory_gib=rng.choice([1, 2, 3]),
                                       containers=rng.randint(1, 3),
                                       weight=rng.choice([None, 1, 2, 4]),
                                       priority=rng.choice([None, None, "low", "high"]))
                claims.append(c)
                log(f"created {c.describe()}")
                if not seen_inside:
                    seen_inside = inside(c)
            elif r < 0.5 and claims:
                c = claims.pop(rng.randrange(len(claims)))
                k.remove_claim_pod(c)
                log(f"removed {c.describe()}")
            elif r < 0.8 and len(allocs) < 4:
                a = k.allocate_pod(units=rng.randint(1, 6), gpus=[2, 3])
                allocs.append(a)
                log(f"allocated {a.describe()}")
            elif allocs:
                a = allocs.pop(rng.randrange(len(allocs)))
                k.release_pod(a)
                log(f"released {a.describe()} (its allocation lingers)")
        except kb.KubeletError as e:
            log(f"refused: {e}")
            if "refused" not in str(e) and "free on GPUs" not in str(e):
                problem("step-failed", str(time.monotonic()), str(e))
        time.sleep(rng.uniform(0.2, 1.0))
    if restarted is None:
        problem("no-restart", "restart", "the run ended before the plugin's restart")
    elif not restarted.get("pod"):
        problem("restart", "restart", f"the pod admitted during the restart did not run: {restarted.get('error')}")
    elif not restarted.get("prepare_in_flight_at_kill"):
        problem("restart", "restart", "the DRA driver was not killed while a prepare was in flight "
                f"(the prepare took {restarted.get('prepare_attempts')} attempt(s))")
    else:
        log(f"restart mid-prepare: the pod ran after {restarted['prepare_attempts']} prepares")
    if not seen_inside:
        problem("inside", "inside", "no claim container was looked into")
    time.sleep(kb.SETTLE + 1)
    for kind, key, msg in k.check(status()):
        problem(kind, key, msg)
    # The end: every pod removed, the lingering allocations released; nothing held.
    quit.set()
    for kind, key, msg in k.drain():
        problem(kind, key, msg)
    deadline = time.monotonic() + 10
    while True:
        st = status()
        held = [f"GPU {g['index']}: {g['capacity'] - g['unreserved']} bytes" for g in st["gpus"]
                if g["unreserved"] != g["capacity"]]
        if not (st["containers"] or st["reservations"] or held) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if st["containers"] or st["reservations"] or held:
        problem("leak-at-end", "end", f"with every pod removed the node holds "
                f"{[c['vgpu'] for c in st['containers']]} attached, "
                f"{[r['vgpu'] + ' ' + str(r.get('claim')) for r in st['reservations']]} reserved, "
                f"memory {held}")
    for kind, key, msg in k.stop():
        problem(kind, key, msg)
    s = k.summary()
    log(f"summary: {json.dumps(s)}; {checks[0]} status checks")

def inside(c):
    """A claim container has its GPU in CUDA_VISIBLE_DEVICES (its init's environment: podman
    exec does not carry the CDI device's env) and the identity of the claim's vGPU."""
    x = c.containers[0]
    p = k.pm("exec", x.id, "cat", "/proc/1/environ", "/run/gpuplex/vgpu.json")
    want = f"CUDA_VISIBLE_DEVICES=GPU-kcheck-{c.gpus[0]}"
    env, _, rest = p.stdout.rpartition("\0")
    if p.returncode != 0 or want not in env.split("\0"):
        problem("inside", c.uid, f"{c.describe()}: its init's environment has no {want}: "
                f"{p.stdout[:300]!r} {p.stderr.strip()[:200]!r}")
        return True
    vgpus = {s["vgpu"] for s in status()["containers"] if s.get("claim") == c.uid}
    try:
        identity = json.loads(rest)
    except ValueError:
        identity = {}
    if identity.get("vgpu") not in vgpus:
        problem("inside", c.uid, f"{c.describe()}: its identity names {identity.get('vgpu')}, "
                f"the node {sorted(vgpus)}")
    return True

try:
    main()
except KeyboardInterrupt:
    print("kubelet_check: interrupted; stopping", flush=True)
    try:
        k.stop()
    finally:
        sys.exit(130)
except Exception as e:  # noqa: BLE001 -- one line, whatever it is
    problem("error", "error", f"{type(e).__name__}: {e}")
    try:
        k.stop()
    except Exception:  # noqa: BLE001
        pass
if problems:
    first = next(iter(problems.values()))
    print(f"kubelet_check: FAILED ({len(problems)} mismatch(es)); the first: {first}", flush=True)
    sys.exit(1)
print("kubelet_check: every check held", flush=True)
PY
rc=$?
set -e
if [ "$rc" != 0 ] && [ "$rc" != 1 ]; then
	echo "kubelet_check: the check itself failed (exit status $rc)"
	rc=2
fi
if [ "$rc" != 0 ]; then
	echo "kubelet_check: logs: $work/kubelet/*.log, $work/service.log (KUBELET_CHECK_KEEP=1 keeps them)" >&2
	if [ "$keep" != 1 ]; then
		for f in "$work"/kubelet/*.log "$work/service.log"; do
			[ -f "$f" ] && { echo "--- $f (last lines)" >&2; tail -5 "$f" >&2; }
		done
	fi
fi
exit "$rc"
