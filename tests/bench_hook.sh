#!/usr/bin/env bash
# What the hook costs a container's start, as ratios measured in one run (docs/benchmarks.md):
#   runc run of a `true` container: with gpuplex-hook in config.json (createRuntime registers and
#     injects, poststop releases) vs the same bundle without it;
#   podman run --rm of a `true` container: with config/hooks.d and a gpuplex.io/ annotation
#     (precreate reserves and edits, createRuntime attaches, poststop releases) vs without.
# Root; needs hyperfine, runc, podman, busybox-static (make bench installs them) and a release
# build (make build). GPUPLEX_BENCH_RUNS sets hyperfine's runs (default 30).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${GPUPLEX_BIN_DIR:-$repo/target/release}
runs=${GPUPLEX_BENCH_RUNS:-30}
[ "$(id -u)" = 0 ] || { echo "bench_hook.sh needs root" >&2; exit 1; }

work=$(mktemp -d /tmp/gpuplex-bench.XXXXXX)
# shellcheck source=tests/lib.sh
. "$repo/tests/lib.sh"
cleanup() {
	gpuplex_stop_service
	gpuplex_remove_work
}
trap cleanup EXIT

gpuplex_start_service 232 "Fake A100" 80Gi
gpuplex_busybox_rootfs "$work/rootfs" sh true

# runc bundles: the same config without hooks, with two hooks that do nothing (/bin/true: what
# runc's hook mechanism costs by itself), and with gpuplex's.
for kind in plain truehook hook; do
	mkdir -p "$work/$kind"
	runc spec --bundle "$work/$kind"
	python3 - "$work/$kind/config.json" "$work/rootfs" "$kind" "$bin/gpuplex-hook" "$work/gpuplex.toml" <<'PY'
import json, sys
path, rootfs, kind, hook, config = sys.argv[1:]
spec = json.load(open(path))
spec["root"] = {"path": rootfs, "readonly": False}
spec["process"]["terminal"] = False
spec["process"]["args"] = ["true"]
if kind == "truehook":
    spec["hooks"] = {stage: [{"path": "/bin/true", "args": ["true"]}]
                     for stage in ("createRuntime", "poststop")}
if kind == "hook":
    spec["annotations"] = {"gpuplex.io/gpu-memory": "1Gi"}
    spec["hooks"] = {stage: [{"path": hook, "args": ["gpuplex-hook", "--config", config, stage]}]
                     for stage in ("createRuntime", "poststop")}
json.dump(spec, open(path, "w"))
PY
done

# podman, with and without the gpuplex hooks.
gpuplex_podman_setup "$work/podman-plain"
gpuplex_podman_setup "$work/podman-hook" hooks
podman_cmd() { # kind, annotation args...
	local kind=$1
	shift
	echo "CONTAINERS_CONF=$work/podman-$kind/containers.conf podman --root $work/podman-$kind/root --runroot $work/podman-$kind/runroot --tmpdir $work/podman-$kind/tmp --storage-driver vfs run --rm --runtime runc --network none $* --rootfs $work/rootfs true"
}

hyperfine --warmup 3 --runs "$runs" --export-json "$work/runc.json" \
	-n "runc run" "runc --root $work/runc-state run --bundle $work/plain bench-plain" \
	-n "runc run + gpuplex-hook" "runc --root $work/runc-state run --bundle $work/hook bench-hook" \
	-n "runc run + two /bin/true hooks" "runc --root $work/runc-state run --bundle $work/truehook bench-true"
hyperfine --warmup 3 --runs "$runs" --export-json "$work/podman.json" \
	-n "podman run --rm" "$(podman_cmd plain)" \
	-n "podman run --rm + gpuplex hooks" "$(podman_cmd hook --annotation gpuplex.io/gpu-memory=1Gi)"

python3 - "$work/runc.json" "$work/podman.json" <<'PY'
import json, sys
runc, podman = (json.load(open(p))["results"] for p in sys.argv[1:])
def line(a, b, goal=None):
    ratio = a["median"] / b["median"]
    tail = f" (goal <= {goal})" if goal else ""
    print(f"{a['command']}: median {a['median']*1e3:.1f} ms vs {b['median']*1e3:.1f} ms "
          f"({b['command']}): ratio {ratio:.3f}{tail}")
print()
print("hyperfine (each command's runs in a row):")
line(runc[1], runc[0], 1.15)
line(runc[2], runc[0])
line(runc[1], runc[2])
line(podman[1], podman[0], 1.10)
PY

# hyperfine runs one command's runs in a row, so a drift of the machine between them (this
# shared VM drifts by ±10%) lands in the ratio. The same pairs again, interleaved: A B A B ...
python3 - "$runs" "$work" "$(podman_cmd plain)" "$(podman_cmd hook --annotation gpuplex.io/gpu-memory=1Gi)" <<'PY'
import statistics, subprocess, sys, time
runs, work, podman_plain, podman_hook = sys.argv[1:]
runs = int(runs)
runc = lambda bundle, name: f"runc --root {work}/runc-state run --bundle {work}/{bundle} {name}"
pairs = [
    ("runc run + gpuplex-hook vs runc run", runc("hook", "i-hook"), runc("plain", "i-plain"), 1.15),
    ("runc run + gpuplex-hook vs runc run + two /bin/true hooks", runc("hook", "i-hook"), runc("truehook", "i-true"), None),
    ("podman run --rm + gpuplex hooks vs podman run --rm", podman_hook, podman_plain, 1.10),
]
def timed(cmd):
    start = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start
print()
print(f"interleaved ({runs} pairs each):")
for name, a, b, goal in pairs:
    for _ in range(3):
        timed(a), timed(b)
    ta, tb = [], []
    for _ in range(runs):
        ta.append(timed(a))
        tb.append(timed(b))
    ma, mb = statistics.median(ta), statistics.median(tb)
    tail = f" (goal <= {goal})" if goal else ""
    print(f"{name}: median {ma*1e3:.1f} ms vs {mb*1e3:.1f} ms: ratio {ma/mb:.3f}{tail}")
PY
