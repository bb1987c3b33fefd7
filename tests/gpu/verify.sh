#!/usr/bin/env bash
# tests/gpu/verify.sh: gpuplex on a real NVIDIA GPU, measured. See tests/gpu/README.md.
#
# Runs the node service with the nvml activity source, puts CUDA matmul loops (matmul.py) in
# cgroups, registers them with gpuplexctl and measures, from the loops' own logs and from
# `gpuplexctl status -o json`: throughput alone (registered or not), how fast gpuplex sees work
# start and stop, the GPU shares under weights, the hand-over between windows, and that every
# cgroup is thawed after the service stops; and, where podman and the NVIDIA Container Toolkit's
# CDI spec are installed, that `nvidia-smi -L` in a podman container with a vGPU lists its GPU
# alone (else that step is one SKIP row, and the rest still counts). Prints a table; exits 0 when
# every check held, 1 when one failed, 2 when the machine is not set up for it (not root,
# binaries missing, ...), and 77 (skip) on a machine without a usable NVIDIA GPU, never a pass it
# did not measure.
#
# Environment: GPUPLEX_BIN_DIR (default <repo>/target/release), PYTHON (default python3),
# GPUPLEX_VERIFY_LOOPS (2 or 3, default 3), GPUPLEX_VERIFY_MEMORY (per loop, default 2Gi),
# GPUPLEX_VERIFY_SECONDS (shares window, default 20), GPUPLEX_VERIFY_KEEP=1 (keep the temp dir),
# GPUPLEX_VERIFY_SHARE_TOL (default 0.10), GPUPLEX_VERIFY_MIN_RATIO (default 0.95).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BIN_DIR=${GPUPLEX_BIN_DIR:-$REPO/target/release}
PYTHON=${PYTHON:-python3}
LOOPS=${GPUPLEX_VERIFY_LOOPS:-3}
MEMORY=${GPUPLEX_VERIFY_MEMORY:-2Gi}
SECONDS_SHARES=${GPUPLEX_VERIFY_SECONDS:-20}
SHIM=$BIN_DIR/containerd-shim-gpuplex-v1
CTL=$BIN_DIR/gpuplexctl
HOOK=$BIN_DIR/gpuplex-hook

skip() { echo "verify.sh: SKIP: cannot run here: $*" >&2; exit 77; }
setup_error() { echo "verify.sh: cannot run: $*" >&2; exit 2; }
say() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
now() { date +%s.%N; }

# ---- Can it run here? A missing GPU is a skip; a GPU machine set up wrong is an error. --------
command -v nvidia-smi >/dev/null 2>&1 || skip "no NVIDIA GPU: nvidia-smi is not installed"
GPU_LIST=$(nvidia-smi -L 2>&1) || skip "no usable NVIDIA GPU: nvidia-smi -L failed: $(head -n1 <<<"$GPU_LIST")"
grep -q '^GPU 0' <<<"$GPU_LIST" || skip "no NVIDIA GPU: nvidia-smi -L lists none"
command -v "$PYTHON" >/dev/null 2>&1 || skip "no $PYTHON to run the CUDA loops"
TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' 2>/dev/null) ||
    skip "no PyTorch for $PYTHON (pip install torch with CUDA)"
[[ $TORCH == *" True" ]] || skip "PyTorch $TORCH sees no CUDA device (a CPU-only build, or a driver mismatch)"
[[ $(id -u) -eq 0 ]] || setup_error "freezing cgroups needs root; run it with sudo"
[[ -x $SHIM && -x $CTL && -x $HOOK ]] || setup_error "gpuplex binaries not found in $BIN_DIR; run cargo build --release or set GPUPLEX_BIN_DIR"
[[ $LOOPS == 2 || $LOOPS == 3 ]] || setup_error "GPUPLEX_VERIFY_LOOPS must be 2 or 3, not $LOOPS"
if [[ $LOOPS == 2 ]]; then WEIGHTS=(1 2); else WEIGHTS=(1 1 2); fi

FREEZER=$(awk '$3 == "cgroup" && $4 ~ /(^|,)freezer(,|$)/ { print $2; exit }' /proc/mounts)
if [[ -n $FREEZER ]]; then
    CG_KIND=v1 CG_ROOT=$FREEZER
else
    CG_KIND=v2 CG_ROOT=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
    [[ -n $CG_ROOT ]] || setup_error "neither a cgroup v1 freezer nor cgroup2 is mounted"
fi

# NVML's GPU 0 by UUID, so that CUDA's device 0 in the loops is the same GPU whatever
# CUDA_DEVICE_ORDER says.
GPU_UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader --id=0)
GPU_MODEL=$(nvidia-smi --query-gpu=name --format=csv,noheader --id=0)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader --id=0)
GPU_COUNT=$(grep -c '^GPU ' <<<"$GPU_LIST")

TMP=$(mktemp -d /tmp/gpuplex-verify.XXXXXX)
mkdir -p "$TMP/state"
SOCK=$TMP/gpuplex.sock
SERVICE_PID=
RECORDER_PID=
declare -a LOOP_IDS=() LOOP_PIDS=() CGROUPS=() PODMAN=()

# ---- Cleanup: always, on every exit ----------------------------------------------------------
thaw() {
    if [[ $CG_KIND == v1 ]]; then echo THAWED >"$1/freezer.state"; else echo 0 >"$1/cgroup.freeze"; fi
}
freeze_state() {
    if [[ $CG_KIND == v1 ]]; then cat "$1/freezer.state"; else cat "$1/cgroup.freeze"; fi
}
cleanup() {
    local rc=$? cg pid i
    trap - EXIT INT TERM
    stop_recorder
    if [[ -n $SERVICE_PID ]] && kill -0 "$SERVICE_PID" 2>/dev/null; then
        kill -TERM "$SERVICE_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$SERVICE_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVICE_PID" 2>/dev/null || true
    fi
    # A frozen process cannot die: thaw first (the service should have, see the fail-open check).
    for cg in "${CGROUPS[@]}"; do [[ -d $cg ]] && { thaw "$cg" 2>/dev/null || true; }; done
    for pid in "${LOOP_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${LOOP_PIDS[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    # A container left by an interrupted step 6 holds an overlay of / under $TMP: remove it first.
    [[ ${#PODMAN[@]} -eq 0 ]] || "${PODMAN[@]}" rm -a -f -t 0 >/dev/null 2>&1 || true
    wait 2>/dev/null || true
    for cg in "${CGROUPS[@]}"; do
        for i in 1 2 3 4 5; do [[ -d $cg ]] || break; rmdir "$cg" 2>/dev/null || sleep 0.2; done
        [[ -d $cg ]] && echo "verify.sh: could not remove cgroup $cg" >&2
    done
    if [[ ${GPUPLEX_VERIFY_KEEP:-0} == 1 || ($rc -ne 0 && $rc -ne 77) ]]; then
        echo "verify.sh: logs kept in $TMP" >&2
    else
        rm -rf --one-file-system "$TMP"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail_setup() {
    echo "verify.sh: FAIL: $*" >&2
    if [[ -f $TMP/service.log ]]; then
        echo "--- last lines of the service's log ($TMP/service.log):" >&2
        tail -n 20 "$TMP/service.log" >&2
    fi
    exit 1
}

ctl() { "$CTL" --socket "$SOCK" "$@"; }
stop_recorder() {
    [[ -n $RECORDER_PID ]] || return 0
    touch "$TMP/record.stop"
    for _ in $(seq 50); do kill -0 "$RECORDER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$RECORDER_PID" 2>/dev/null || true
    RECORDER_PID=
}
status_json() { ctl status -o json; }
check() { echo "$*" >>"$TMP/checks"; } # name PASS|FAIL detail...
snapshot() { # file: the status document now
    status_json >"$TMP/$1" 2>"$TMP/ctl.err" || fail_setup "gpuplexctl status failed: $(head -n1 "$TMP/ctl.err")"
}

# ---- 1. The node service ---------------------------------------------------------------------
# `policy = "pack"`: on a machine with several GPUs every loop must land on GPU 0 (where they
# run); the loops are registered while none of them has work, so pack puts them together.
cat >"$TMP/gpuplex.toml" <<EOF
[scheduler]
slice = "200ms"
policy = "pack"

[service]
socket = "$SOCK"
state_dir = "$TMP/state"
activity = "nvml"
sample_interval = "50ms"
EOF
say "starting the node service ($SHIM serve, config $TMP/gpuplex.toml)"
"$SHIM" serve --config "$TMP/gpuplex.toml" >"$TMP/service.log" 2>&1 &
SERVICE_PID=$!
for _ in $(seq 300); do
    status_json >"$TMP/status-start.json" 2>/dev/null && break
    kill -0 "$SERVICE_PID" 2>/dev/null || fail_setup "the node service exited at start"
    sleep 0.1
done
status_json >"$TMP/status-start.json" 2>"$TMP/ctl.err" || fail_setup "gpuplexctl status did not answer within 30 s: $(head -n1 "$TMP/ctl.err")"
read -r ACTIVITY FAKE < <("$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); print(d["activity"], d["gpus"][0]["fake"] if d["gpus"] else "none")' <"$TMP/status-start.json")
if [[ $ACTIVITY == nvml && $FAKE == False ]]; then
    check activity_source PASS "nvml, GPU 0 real"
else
    check activity_source FAIL "activity $ACTIVITY, GPU 0 fake=$FAKE"
fi

{
    echo "gpu $GPU_MODEL"
    echo "driver $DRIVER"
    echo "gpus $GPU_COUNT"
    echo "cgroups $CG_KIND"
    echo "slice 200ms"
} >"$TMP/meta"

# ---- 2. The loops, each in its cgroup, waiting for its gate ----------------------------------
# Each is moved into its cgroup before it starts python (the wrapper writes its own pid, then
# execs), so every thread CUDA starts is in the cgroup from the beginning.
start_loop() { # id
    local id=$1 cg="$CG_ROOT/gpuplex-verify-$$-$1"
    mkdir "$cg"
    CGROUPS+=("$cg")
    CUDA_VISIBLE_DEVICES=$GPU_UUID bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cg" \
        "$PYTHON" "$HERE/matmul.py" --log "$TMP/$id.log" --trace "$TMP/$id.trace" \
        --gate "$TMP/$id.gate" --ready "$TMP/$id.ready" >"$TMP/$id.out" 2>&1 &
    LOOP_IDS+=("$id")
    LOOP_PIDS+=("$!")
}
for n in $(seq "$LOOPS"); do
    start_loop "loop$n"
    echo "loop$n ${WEIGHTS[n - 1]}" >>"$TMP/weights"
done
say "waiting for $LOOPS CUDA loops to initialize"
for i in "${!LOOP_IDS[@]}"; do
    id=${LOOP_IDS[i]}
    for _ in $(seq 1200); do
        [[ -f $TMP/$id.ready ]] && break
        kill -0 "${LOOP_PIDS[i]}" 2>/dev/null || fail_setup "$id exited: $(tail -n1 "$TMP/$id.out")"
        sleep 0.1
    done
    [[ -f $TMP/$id.ready ]] || fail_setup "$id did not initialize CUDA within 120 s"
    say "$id: $(cat "$TMP/$id.ready")"
done

register() { # id weight
    local cg="$CG_ROOT/gpuplex-verify-$$-$1"
    ctl register --id "$1" --cgroup "$cg" --annotation "gpuplex.io/weight=$2" \
        --annotation "gpuplex.io/gpu-memory=$MEMORY" >"$TMP/$1.assignment" 2>"$TMP/$1.register.err" ||
        fail_setup "gpuplexctl register $1 failed: $(head -n1 "$TMP/$1.register.err")"
}
phase() { echo "$1 $2 $3" >>"$TMP/phases"; }
detect() { # start|idle id  (opens or closes the gate, times the state change)
    local state=running action=--touch seconds
    [[ $1 == idle ]] && state=idle action=--remove
    seconds=$("$PYTHON" "$HERE/analyze.py" wait --ctl "$CTL" --socket "$SOCK" --id "$2" \
        --state "$state" "$action" "$TMP/$2.gate" --timeout 10) || true
    echo "$1 $2 ${seconds:-timeout}" >>"$TMP/detect"
    say "$2: $1 seen after ${seconds:-timeout} s"
}

# ---- 3. Throughput alone: not registered, then registered ------------------------------------
# The same process both times, so the ratio compares gpuplex's overhead, not two contexts.
say "loop1 alone, not registered (3 s warm-up, 10 s measured)"
touch "$TMP/loop1.gate"
sleep 3
t0=$(now); sleep 10; t1=$(now)
phase alone_unregistered "$t0" "$t1"

register loop1 "${WEIGHTS[0]}"
say "loop1 alone, registered: $(tr -d '\n' <"$TMP/loop1.assignment" | cut -c1-160)"
sleep 3
t0=$(now); sleep 10; t1=$(now)
phase alone_registered "$t0" "$t1"
snapshot status-alone.json

# ---- 4. How fast work is seen to stop and start ----------------------------------------------
# From the gate file's change to the first `gpuplexctl status` that shows the new state, polled
# every ~10 ms: includes the loop noticing its gate (<= 5 ms, plus finishing the batch in
# flight when stopping), NVML's own sampling, the service's sample_interval and idle_grace.
detect idle loop1
for n in $(seq 2 "$LOOPS"); do register "loop$n" "${WEIGHTS[n - 1]}"; done
snapshot status-registered.json
if "$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); g={tuple(c["gpus"]) for c in d["containers"]}; sys.exit(0 if g == {(0,)} else 1)' <"$TMP/status-registered.json"; then
    check same_gpu PASS "every loop bound to GPU 0"
else
    check same_gpu FAIL "the loops are not all bound to GPU 0 alone (see $TMP/status-registered.json)"
fi
# From here to the end of the shares, record.py writes the cgroups' freezer states, the
# service's container states and NVML's raw samples under $TMP/record (see record.py).
"$PYTHON" "$HERE/record.py" --ctl "$CTL" --socket "$SOCK" --out "$TMP/record" \
    --stop "$TMP/record.stop" "${CGROUPS[@]}" >"$TMP/record.err" 2>&1 &
RECORDER_PID=$!
for _ in 1 2 3; do
    detect start loop2
    sleep 1
    detect idle loop2
    sleep 0.5
done

# ---- 5. Shares under weights, and the hand-over between windows -----------------------------
say "all $LOOPS loops with work, weights ${WEIGHTS[*]} (3 s warm-up, $SECONDS_SHARES s measured)"
for id in "${LOOP_IDS[@]}"; do touch "$TMP/$id.gate"; done
sleep 3
snapshot status-shares-begin.json
t0=$(now); sleep "$SECONDS_SHARES"; t1=$(now)
snapshot status-shares-end.json
phase shares "$t0" "$t1"
for id in "${LOOP_IDS[@]}"; do rm -f "$TMP/$id.gate"; done
sleep 1
snapshot status-final.json
stop_recorder

# ---- 6. A podman container with a vGPU sees exactly its GPU ----------------------------------
# gpuplex's podman hooks (config/hooks.d, run against this service) on a container whose root is
# an overlay of the host's, so that no image or registry is needed: the toolkit's CDI spec, which
# the service reads from its default cdi_spec_dirs, brings the driver's edits, and the hook adds
# the assigned GPU's device entry alone. Needs podman and that spec; without them, one SKIP row.
new_vgpus() { # before.json after.json: the vGPUs (containers or reservations) only after holds
    "$PYTHON" -c 'import json,sys
held = lambda p: {x["vgpu"] for d in [json.load(open(p))] for x in d["containers"] + d["reservations"]}
print(" ".join(sorted(held(sys.argv[2]) - held(sys.argv[1]))))' "$TMP/$1" "$TMP/$2"
}
container_step() {
    local spec cdi rc=0 vgpu assigned listed others=() seen=() uuid left t0 waited runtime=()
    command -v podman >/dev/null 2>&1 || { check container SKIP "no podman: apt-get install podman"; return; }
    spec=$(grep -lsE '"?kind"?[[:space:]]*:[[:space:]]*"?nvidia\.com/gpu("|[[:space:]]*$)' \
        /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json | head -n1) || true
    if [[ -z $spec ]]; then
        check container SKIP "no CDI spec: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"
        return
    fi
    # The shipped hooks.d files, pointed at this build and this service's config.
    "$PYTHON" - "$REPO/config/hooks.d" "$TMP/hooks.d" "$HOOK" "$TMP/gpuplex.toml" <<'EOF'
import json, os, sys
src, dst, hook, config = sys.argv[1:]
os.makedirs(dst)
for name in os.listdir(src):
    h = json.load(open(os.path.join(src, name)))
    h["hook"].update(path=hook, args=["gpuplex-hook", "--config", config, h["stages"][0]])
    with open(os.path.join(dst, name), "w") as f:
        json.dump(h, f)
EOF
    # A private store (vfs: nothing is stored with --rootfs), cgroupfs and a file event log, so
    # that neither the host's podman state nor systemd is needed or touched.
    PODMAN=(podman --root "$TMP/podman/root" --runroot "$TMP/podman/run" --tmpdir "$TMP/podman/tmp"
        --storage-driver vfs --cgroup-manager cgroupfs --events-backend file --hooks-dir "$TMP/hooks.d")
    # runc where there is one: crun refuses hosts with hybrid cgroups.
    command -v runc >/dev/null 2>&1 && runtime=(--runtime runc)
    snapshot status-container-before.json
    cdi=$("$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["cdi"])' <"$TMP/status-container-before.json")
    if [[ $cdi == "nvidia.com/gpu from "* ]]; then
        check container_CDI_spec PASS "$cdi"
    else
        check container_CDI_spec FAIL "found $spec, but the service says: $cdi"
    fi
    say "podman: nvidia-smi -L in a container with a 1Gi vGPU (CDI spec $spec)"
    # `--rootfs /:O`: the host's root as an overlay (its writes land under $TMP). podman's
    # default nofile/nproc limits exceed what some hosts (containers among them) allow.
    timeout 120 "${PODMAN[@]}" run --rm "${runtime[@]}" --network none \
        --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 --annotation gpuplex.io/gpu-memory=1Gi \
        --rootfs /:O sh -c 'cat /run/gpuplex/vgpu.json && nvidia-smi -L' \
        >"$TMP/container.out" 2>"$TMP/container.err" </dev/null || rc=$?
    t0=$(now)
    if [[ $rc -eq 0 ]]; then
        check container_run PASS "podman run exited 0"
    else
        # The first line, from a failed hook its own line (runc wraps it in one of its own).
        check container_run FAIL "podman run exited $rc: $(sed -n '/./{s/.*stderr: //;p;q}' "$TMP/container.err" | cut -c1-100)"
    fi
    # The identity (/run/gpuplex/vgpu.json, printed first) names the assigned GPU.
    vgpu=$(grep -m1 -o '"vgpu": *"[^"]*"' "$TMP/container.out" | cut -d'"' -f4) || true
    assigned=$(grep -o '"uuid": *"[^"]*"' "$TMP/container.out" | cut -d'"' -f4 | paste -sd' ') || true
    listed=$(grep -E '^GPU [0-9]+: .*\(UUID: GPU-' "$TMP/container.out" |
        sed -E 's/.*\(UUID: ([^)]*)\).*/\1/' | paste -sd' ') || true
    if [[ -n $assigned && $listed == "$assigned" ]]; then
        check container_sees_its_GPU PASS "$listed only ($vgpu)"
    else
        check container_sees_its_GPU FAIL "nvidia-smi -L: ${listed:-no GPU}; assigned: ${assigned:-none}"
    fi
    if [[ $GPU_COUNT -gt 1 && -n $assigned ]]; then
        mapfile -t others < <(nvidia-smi --query-gpu=uuid --format=csv,noheader |
            grep -vxF "${assigned:-none}")
        for uuid in "${others[@]}"; do grep -qF "$uuid" "$TMP/container.out" && seen+=("$uuid"); done
        if [[ ${#seen[@]} -eq 0 ]]; then
            check container_sees_no_other_GPU PASS "none of the other ${#others[@]} GPUs' UUIDs"
        else
            check container_sees_no_other_GPU FAIL "${seen[*]}"
        fi
    fi
    # poststop releases the vGPU; nothing the run reserved may outlive it by more than 3 s.
    for _ in $(seq 30); do
        snapshot status-container-after.json
        left=$(new_vgpus status-container-before.json status-container-after.json)
        [[ -z $left ]] && break
        sleep 0.1
    done
    waited=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    if [[ -z $left ]]; then
        check container_released PASS "no vGPU left $waited s after exit${vgpu:+ (was $vgpu)}"
    else
        check container_released FAIL "still held 3 s after exit: $left"
    fi
}
container_step

# ---- 7. Fail open: the service's SIGTERM thaws everything it froze ---------------------------
# Freeze-prone moment: every loop gets work again, then the service is stopped mid-window.
for id in "${LOOP_IDS[@]}"; do touch "$TMP/$id.gate"; done
sleep 2
say "stopping the node service (SIGTERM) while loops hold and wait for windows"
kill -TERM "$SERVICE_PID"
for _ in $(seq 150); do kill -0 "$SERVICE_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$SERVICE_PID" 2>/dev/null; then
    kill -KILL "$SERVICE_PID"
    check service_exit FAIL "still running 15 s after SIGTERM (killed)"
fi
service_rc=0
wait "$SERVICE_PID" || service_rc=$?
SERVICE_PID=
if [[ $service_rc -eq 0 ]]; then
    check service_exit PASS "0 after SIGTERM"
elif [[ $service_rc -ne 137 ]]; then
    check service_exit FAIL "$service_rc after SIGTERM"
fi
for i in "${!LOOP_IDS[@]}"; do
    echo "${LOOP_IDS[i]} $(freeze_state "${CGROUPS[i]}")" >>"$TMP/failopen"
done
for id in "${LOOP_IDS[@]}"; do rm -f "$TMP/$id.gate"; done

"$PYTHON" "$HERE/analyze.py" report "$TMP"
