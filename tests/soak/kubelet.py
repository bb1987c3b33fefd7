"""make soak: the kubelet's side of gpuplex's kubelet plugins (issue #31), over their real sockets.

No kubelet or kube-apiserver runs on these machines. `Kubelet` plays both ends of them around
the real `gpuplex-dra` binary:

- the kubelet stand-in (`kubelet-standin`, dra/examples/kubelet-standin.rs, Rust: Python has no
  gRPC here) serves the API server's ResourceClaims and ResourceSlices, the kubelet's plugin
  registry and its device-plugin registration socket, and makes the kubelet's gRPC calls
  (registration, NodePrepareResources / NodeUnprepareResources, ListAndWatch,
  GetPreferredAllocation, Allocate), one JSON command per line;
- two `gpuplex-dra` processes against the node service: the DRA driver (the node's own
  gpuplex.toml) and the device plugin (a copy of it with `[kubernetes] plugin =
  "device-plugin"`, `device_plugin_devices = "cdi"`), both writing CDI specs where podman reads
  them (/var/run/cdi);
- pods as podman containers: a claim pod's 1-3 containers share its CDI device
  (`--device gpuplex.io/vgpu=<claim uid>`, whose attach step attaches them to the claim's vGPU),
  an allocation pod's container has its units' CDI device (`gpuplex.io/vgpu=units-...`).

The API the soak calls (each method is thread-safe; the calls that fail raise KubeletError with
one line, and leave nothing of theirs behind but what the kubelet itself would leave):

    k = Kubelet(work=..., bin_dir=..., node_config=..., node_socket=..., podman=[...], rootfs=...)
    k.start()                               # stand-in, both plugins, registrations
    pod = k.create_claim_pod(gpu=1, memory_gib=2, containers=2)    # ClaimPod, running
    k.remove_claim_pod(pod)                 # containers removed, then unprepared (retried)
    pod = k.allocate_pod(units=3, gpus=[2, 3])                     # AllocPod, running
    k.release_pod(pod)                      # its container removed, its units free again
    k.restart_plugin(mid_prepare=True)      # kill -9 of the DRA driver while a prepare waits
                                            # for its claim; started again; the prepare retried
    k.live()                                # what is live, for the soak's own checks
    k.check(status)                         # the node's status against it: [(kind, key, msg)]
    k.drain()                               # every pod removed, lingering allocations released
    k.stop()                                # plugins and stand-in stopped, specs removed

Device-plugin allocations outlive their pods by design: the kubelet never tells the plugin a
pod is gone, and the node releases an allocation when the kubelet gives any of its units again
(gpuplex_scheduler::node::allocated). A released pod's allocation is therefore *lingering*:
it must stay pinned (with its memory) until its units are given again, and then it must go.
`drain()` ends the lingering ones as an operator would, `{"op":"release","claim":"units-..."}`
on the node socket, and waits for the device plugin to remove their CDI specs.
"""
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid

from node import alive, request

GiB = 1 << 30
CDI_DIR = "/var/run/cdi"  # podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi
BUSY = "while :; do :; done"
IDLE = "sleep 1000000"
SETTLE = 3.0  # seconds after a change before the node's status must show it
PREPARE_DEADLINE = 60.0  # seconds the kubelet keeps retrying a prepare or an unprepare
UNITS_FRESH = 5.0  # seconds a ListAndWatch list is used before it is read again
# A prepare refused for what it asks (the node says so), not for a passing fault: not retried.
REFUSED = re.compile(r"unreserved and|is not allowed|VgpuConfig|not a gpuplex GPU|is not allocated|"
                     r"prepared already|not this node's|has no GPU|consumes")


class KubeletError(Exception):
    """A step the kubelet could not take: one line."""


def node_request(path, line):
    """One request line on the node socket: its reply as a dict (node.request's)."""
    return request(path, line)[0]


class StandIn:
    """The Rust stand-in: one JSON command per line in, one answer per line out, by id."""

    def __init__(self, binary, directory, node, log_path):
        self.log_file = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "--dir", directory, "--node", node], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log_file, start_new_session=True)
        self.lock = threading.Lock()
        self.pending = {}  # id: [Event, answer]
        self.next_id = 0
        self.ready = None
        got = threading.Event()

        def reader():
            for raw in self.proc.stdout:
                try:
                    answer = json.loads(raw)
                except ValueError:
                    continue
                if self.ready is None and "ready" in answer:
                    self.ready = answer["ready"]
                    got.set()
                    continue
                with self.lock:
                    slot = self.pending.get(answer.get("id"))
                if slot is not None:
                    slot[1] = answer
                    slot[0].set()
            got.set()
            with self.lock:
                for slot in self.pending.values():
                    if slot[1] is None:
                        slot[1] = {"ok": False, "error": "the kubelet stand-in exited",
                                   "code": "Unavailable"}
                        slot[0].set()

        threading.Thread(target=reader, name="kubelet-standin", daemon=True).start()
        if not got.wait(30) or self.ready is None:
            self.close()
            raise KubeletError(f"the kubelet stand-in did not start (its log: {log_path})")

    def call(self, op, wait=None, **fields):
        """The answer to one command (a dict with "ok"); `wait` bounds the wait for it."""
        with self.lock:
            self.next_id += 1
            n = self.next_id
            slot = self.pending[n] = [threading.Event(), None]
        line = json.dumps(dict(fields, op=op, id=n)) + "\n"
        try:
            with self.lock:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()
        except (OSError, ValueError):
            with self.lock:
                self.pending.pop(n, None)
            return {"ok": False, "error": "the kubelet stand-in is gone", "code": "Unavailable"}
        asked = fields.get("timeout_ms", 30000)
        timeout = wait if wait is not None else (
            asked / 1000 + 10 if isinstance(asked, (int, float)) else 40)
        done = slot[0].wait(timeout)
        with self.lock:
            self.pending.pop(n, None)
        if not done:
            return {"ok": False, "error": f"{op}: the stand-in did not answer in {timeout:.0f}s",
                    "code": "DeadlineExceeded"}
        return slot[1]

    def close(self):
        if self.proc.poll() is None:
            try:
                with self.lock:
                    self.proc.stdin.write(b'{"op":"quit"}\n')
                    self.proc.stdin.flush()
                    self.proc.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


class Plugin:
    """One `gpuplex-dra` process, as the DaemonSet runs it (restartable)."""

    def __init__(self, kind, argv, env, log_path):
        self.kind, self.argv, self.env, self.log_path = kind, argv, env, log_path
        self.proc = None
        self.starts = 0

    def start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, env=self.env, start_new_session=True)
        self.starts += 1

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self):
        """SIGTERM (it removes its sockets), SIGKILL after 10 s; its exit status."""
        if not self.alive():
            return None if self.proc is None else self.proc.returncode
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def tail(self, n=3):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(re.sub(r"\x1b\[[0-9;]*m", "", x) for x in lines[-n:])


class PodContainer:
    """One podman container of a pod."""

    def __init__(self, name, cid, pid):
        self.name, self.id, self.pid = name, cid, pid

    def alive(self):
        try:
            with open(f"/proc/{self.pid}/cgroup") as f:
                if self.id not in f.read():
                    return False
        except (OSError, TypeError):
            return False
        return alive(self.pid)


class ClaimPod:
    """A pod with one ResourceClaim shared by its containers."""

    def __init__(self, name, namespace, uid, gpus, memory_gib, weight, priority):
        self.name, self.namespace, self.uid = name, namespace, uid
        self.gpus, self.memory = list(gpus), memory_gib * GiB
        self.memory_text = f"{memory_gib}Gi"
        self.weight, self.priority = weight, priority
        self.containers = []
        self.state = "new"  # new, preparing, starting, running, removing, gone, failed
        self.changed = time.monotonic()
        self.attempts = 0  # NodePrepareResources calls made
        self.error = None

    def describe(self):
        return (f"claim pod {self.namespace}/{self.name} ({self.uid[:8]}, {self.memory_text} on "
                f"GPU {','.join(map(str, self.gpus))}, {len(self.containers)} container(s))")


class AllocPod:
    """A pod whose one container asked for `gpuplex.io/gpu-memory` units."""

    def __init__(self, name, units):
        self.name, self.units = name, list(units)
        self.gpu = int(self.units[0].split("-")[1]) if self.units else None
        self.memory = 0
        self.key = None  # the allocation's claim key, units-<lowest unit>
        self.cdi_device = None
        self.containers = []
        # new, allocating, starting, running, removing, lingering (pod gone, units not given
        # again: it stays pinned), superseded (its units given again: it must be gone),
        # uncertain (an Allocate that failed touched its units), failed, ended (drained)
        self.state = "new"
        self.changed = time.monotonic()
        self.error = None

    def describe(self):
        return f"allocation pod {self.name} ({self.key or '?'}, {len(self.units)} units on GPU {self.gpu})"


class Kubelet:
    def __init__(self, *, work, bin_dir, node_config, node_socket, podman, rootfs, log=None,
                 standin=None, cdi_dir=CDI_DIR, node="soaknode", namespace="soak", cpus=None,
                 device_plugin=True, unit=GiB, rng=None, run_id=None):
        """`work`: a directory of its own (made); `bin_dir`: gpuplex-dra and gpuplex-hook;
        `standin`: the stand-in (default: bin_dir/examples/kubelet-standin); `node_config`,
        `node_socket`: the node service's; `podman`: podman's command prefix (a list);
        `rootfs`: the busybox rootfs; `log`: a callable taking one line; `cpus`: podman --cpus
        of each container (None: no limit); `run_id`: 8 hex digits that start every claim uid
        and name of this run (default: random), so that a cleanup can find them."""
        self.work, self.bin_dir = work, bin_dir
        self.standin_bin = standin or os.path.join(bin_dir, "examples", "kubelet-standin")
        self.node_config, self.node_socket = node_config, node_socket
        self.podman, self.rootfs, self.cdi_dir = list(podman), rootfs, cdi_dir
        self.node, self.namespace, self.cpus = node, namespace, cpus
        self.with_device_plugin, self.unit = device_plugin, unit
        self.log = log or (lambda msg: print(msg, flush=True))
        self.rng = rng or random.Random()
        self.run_id = run_id or uuid.uuid4().hex[:8]  # in every uid and name of this run
        if not re.fullmatch(r"[0-9a-f]{8}", self.run_id):
            raise KubeletError(f"run_id {self.run_id!r} is not 8 hex digits")
        self.lock = threading.Lock()
        self.claims = []  # every ClaimPod of the run
        self.allocs = []  # every AllocPod of the run
        self.units_listed = []  # the device plugin's units, as ListAndWatch last listed them
        self.units_at = 0.0  # when
        self.seq = 0
        self.restarts = []  # what each restart_plugin did
        self.standin = None
        self.dra = self.dp = None
        self.ready = None

    # --- processes -------------------------------------------------------------------------
    def start(self):
        """The stand-in, the DRA driver and (unless told not to) the device plugin, each
        registered with the kubelet; the device plugin's units listed."""
        os.makedirs(self.work, exist_ok=True)
        for path in (self.standin_bin, os.path.join(self.bin_dir, "gpuplex-dra")):
            if not os.access(path, os.X_OK):
                raise KubeletError(f"{path} is not built (cargo build --release -p gpuplex-dra "
                                   "--bin gpuplex-dra --example kubelet-standin)")
        self.standin = StandIn(self.standin_bin, os.path.join(self.work, "kubelet"), self.node,
                               os.path.join(self.work, "kubelet-standin.log"))
        self.ready = self.standin.ready
        env = dict(os.environ, KUBECONFIG=self.ready["kubeconfig"], NO_COLOR="1")
        common = ["--node", self.node, "--cdi-dir", self.cdi_dir,
                  "--hook", os.path.join(self.bin_dir, "gpuplex-hook")]
        binary = os.path.join(self.bin_dir, "gpuplex-dra")
        self.dra = Plugin("dra", [binary, "--config", self.node_config, *common,
                                  "--registry-dir", self.ready["registry_dir"],
                                  "--plugin-dir", self.ready["plugin_dir"]],
                          env, os.path.join(self.work, "gpuplex-dra.log"))
        self.dra.start()
        self.register()
        if self.with_device_plugin:
            config = os.path.join(self.work, "gpuplex-device-plugin.toml")
            with open(self.node_config) as f:
                text = f.read()
            with open(config, "w") as f:
                f.write(device_plugin_config(text))
            self.dp = Plugin("device-plugin", [binary, "--config", config, *common,
                                               "--kubelet-socket", self.ready["kubelet_socket"],
                                               "--poll", "500ms"],
                             env, os.path.join(self.work, "gpuplex-device-plugin.log"))
            self.dp.start()
            got = self.standin.call("dp_registrations", at_least=1, timeout_ms=20000)
            if not got["ok"]:
                raise KubeletError(f"the device plugin did not register: {got['error']}; "
                                   f"its log: {self.dp.tail()}")
            reg = got["registrations"][-1]
            if reg["resource_name"] != "gpuplex.io/gpu-memory":
                raise KubeletError(f"the device plugin registered {reg['resource_name']}")
            self.list_units()
        self.log(f"kubelet: up (run {self.run_id}): DRA driver pid {self.dra.proc.pid}"
                 + (f", device plugin pid {self.dp.proc.pid}, {len(self.units_listed)} units"
                    if self.dp else ""))

    def register(self, timeout=20.0):
        """The DRA driver's registration, as the kubelet's plugin watcher makes it."""
        got = self.standin.call("register", timeout_ms=int(timeout * 1000))
        if not got["ok"]:
            raise KubeletError(f"the DRA driver did not register: {got['error']}; "
                               f"its log: {self.dra.tail()}")
        return got

    def list_units(self):
        got = self.standin.call("list", timeout_ms=20000)
        if not got["ok"]:
            raise KubeletError(f"ListAndWatch: {got['error']}")
        with self.lock:
            self.units_listed, self.units_at = got["units"], time.monotonic()
        return got["units"]

    def stop(self):
        """Everything this kubelet started, stopped; nothing of it left: pods (drain) first
        when the node can still be reached, then the plugins (SIGTERM), the stand-in, and the
        CDI specs of this run that a killed plugin may have left."""
        problems = []
        try:
            node_request(self.node_socket, '{"op":"status"}')
            reachable = True
        except (OSError, ValueError) as e:
            reachable = False
            problems.append(("drain-skipped", "drain", f"the node service does not answer ({e}): "
                             "the pods are removed without unpreparing their claims"))
        try:
            if reachable and self.standin is not None:
                problems = self.drain()
            else:
                with self.lock:
                    pods = [p for p in self.claims + self.allocs if p.containers]
                for p in pods:
                    self.remove_containers(p.containers)
        except Exception as e:  # noqa: BLE001 -- the cleanup goes on whatever failed
            problems.append(("drain-failed", "drain", f"drain: {e}"))
        for p in (self.dp, self.dra):
            if p is not None:
                code = p.stop()
                if code not in (None, 0):
                    problems.append(("plugin-exit", p.kind, f"gpuplex-dra ({p.kind}) exited "
                                     f"with {code} at SIGTERM: {p.tail()}"))
        if self.standin is not None:
            self.standin.close()
        left = self.leftover_specs()
        if left and reachable:
            problems.append(("cdi-spec-leak", "stop", f"with every claim unprepared, CDI specs "
                             f"of this run are left in {self.cdi_dir}: {left}"))
        # Those, and the specs of this run's allocations (the device plugin removes them only
        # while it runs; under the soak's lock nobody else has allocations here).
        with self.lock:
            keys = {a.key for a in self.allocs if a.key}
        for name in left + [f"gpuplex.io-vgpu-{k}.json" for k in sorted(keys)]:
            try:
                os.unlink(os.path.join(self.cdi_dir, name))
            except OSError:
                pass
        return problems

    def leftover_specs(self):
        """This run's claims' CDI spec files (and temporary files) in the CDI directory."""
        try:
            names = os.listdir(self.cdi_dir)
        except OSError:
            return []
        return [n for n in names if f"gpuplex.io-vgpu-{self.run_id}-" in n]

    # --- podman ------------------------------------------------------------------------------
    def pm(self, *args, timeout=90):
        return subprocess.run(self.podman + list(args), capture_output=True, text=True,
                              timeout=timeout)

    def run_container(self, name, device, script):
        args = ["run", "-d", "--name", name, "--runtime", "runc", "--network", "none",
                "--device", device]
        if self.cpus:
            args += ["--cpus", str(self.cpus)]
        args += ["--rootfs", self.rootfs, "sh", "-c", script]
        try:
            p = self.pm(*args)
        except subprocess.TimeoutExpired:
            self.pm("rm", "-f", "-t", "0", name)
            raise KubeletError(f"podman run {name}: no answer in 90 s") from None
        if p.returncode != 0:
            self.pm("rm", "-f", "-t", "0", name)
            line = ([x for x in p.stderr.splitlines() if x.strip()] or ["(no message)"])[-1]
            raise KubeletError(f"podman run {name} --device {device}: {line.strip()}")
        cid = p.stdout.strip().splitlines()[-1]
        q = self.pm("inspect", "--format", "{{.State.Pid}}", cid, timeout=30)
        try:
            pid = int(q.stdout.strip())
        except ValueError:
            pid = None
        return PodContainer(name, cid, pid)

    def remove_containers(self, containers):
        if not containers:
            return None
        try:
            p = self.pm("rm", "-f", "-t", "0", *[c.id for c in containers])
        except subprocess.TimeoutExpired:
            return "podman rm: no answer in 90 s"
        return None if p.returncode == 0 else f"podman rm: {p.stderr.strip()}"

    def scripts(self, n, script):
        if script is not None:
            return [script] * n
        return [self.rng.choice([BUSY, IDLE, BUSY]) for _ in range(n)]

    # --- claims (DRA) --------------------------------------------------------------------------
    def create_claim_pod(self, gpu=None, memory_gib=None, containers=None, weight=None,
                         priority=None, script=None):
        """A pod with one claim of `memory_gib` on GPU `gpu` (an index, or a list of them;
        None: the node's GPU with the most unreserved memory, as kube-scheduler's choice):
        the claim served by the API stand-in, NodePrepareResources (retried through plugin
        restarts and node service restarts, as the kubelet retries), then `containers` (1-3)
        podman containers with the claim's CDI device. Returns the running ClaimPod; raises
        KubeletError (the claim unprepared and deleted) when it cannot run."""
        memory_gib = memory_gib or self.rng.choice([1, 1, 2, 2, 3, 4])
        containers = containers or self.rng.randint(1, 3)
        if gpu is None:
            gpu = self.roomiest_gpu(memory_gib * GiB)
        gpus = gpu if isinstance(gpu, list) else [gpu]
        with self.lock:
            self.seq += 1
            seq = self.seq
        uid = f"{self.run_id}-{str(uuid.uuid4())[9:]}"  # a UUID's shape, the run's first
        pod = ClaimPod(f"claim-{self.run_id}-{seq}", self.namespace, uid, gpus, memory_gib,
                       weight, priority)
        fields = dict(namespace=pod.namespace, name=pod.name, uid=pod.uid,
                      gpu=[f"gpu-{g}" for g in gpus], memory=pod.memory_text)
        if weight is not None:
            fields["weight"] = weight
        if priority is not None:
            fields["priority"] = priority
        with self.lock:
            self.claims.append(pod)
        self.set_state(pod, "preparing")
        got = self.standin.call("claim", **fields)
        if not got["ok"]:
            self.set_state(pod, "failed", got["error"])
            raise KubeletError(f"{pod.describe()}: the API stand-in refused it: {got['error']}")
        try:
            device = self.prepare(pod)
        except KubeletError as e:
            self.unprepare(pod, quiet=True)
            self.standin.call("delete_claim", namespace=pod.namespace, name=pod.name)
            self.set_state(pod, "failed", str(e))
            raise
        self.set_state(pod, "starting")
        try:
            for i, script in enumerate(self.scripts(containers, script)):
                c = self.run_container(f"{pod.name}-{i}", device, script)
                with self.lock:
                    pod.containers.append(c)
        except KubeletError as e:
            self.remove_containers(pod.containers)
            self.unprepare(pod, quiet=True)
            self.standin.call("delete_claim", namespace=pod.namespace, name=pod.name)
            self.set_state(pod, "failed", str(e))
            raise
        self.set_state(pod, "running")
        return pod

    def roomiest_gpu(self, need):
        try:
            st = node_request(self.node_socket, '{"op":"status"}')["status"]
        except (OSError, ValueError, KeyError):
            return 0
        fits = [g for g in st["gpus"] if g["unreserved"] >= need] or st["gpus"]
        return max(fits, key=lambda g: (g["unreserved"], -g["index"]))["index"]

    def prepare(self, pod):
        """NodePrepareResources until it succeeds, is refused for what the claim asks, or
        PREPARE_DEADLINE passes; the claim's CDI device."""
        deadline = time.monotonic() + PREPARE_DEADLINE
        delay = 0.1
        while True:
            pod.attempts += 1
            got = self.standin.call("prepare", uids=[pod.uid], timeout_ms=20000)
            if got["ok"]:
                answer = got["claims"].get(pod.uid)
                if answer is None:
                    why = f"NodePrepareResources answered no claim {pod.uid}"
                elif answer["error"]:
                    why = answer["error"]
                    if REFUSED.search(why):
                        raise KubeletError(f"{pod.describe()}: refused: {why}")
                else:
                    ids = [i for d in answer["devices"] for i in d["cdi_device_ids"]]
                    want = f"gpuplex.io/vgpu={pod.uid}"
                    if ids != [want] * len(pod.gpus) or not ids:
                        raise KubeletError(f"{pod.describe()}: prepared as {ids}, not {want}")
                    return want
            else:
                why = got["error"]
            if time.monotonic() > deadline:
                raise KubeletError(f"{pod.describe()}: not prepared within "
                                   f"{PREPARE_DEADLINE:.0f}s: {why}")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def unprepare(self, pod, quiet=False):
        """NodeUnprepareResources until it succeeds or PREPARE_DEADLINE passes; the error."""
        deadline = time.monotonic() + PREPARE_DEADLINE
        delay = 0.1
        while True:
            got = self.standin.call("unprepare", claims=[
                {"namespace": pod.namespace, "name": pod.name, "uid": pod.uid}], timeout_ms=20000)
            if got["ok"]:
                why = (got["claims"].get(pod.uid) or {"error": "no answer for the claim"})["error"]
                if not why:
                    return None
            else:
                why = got["error"]
            if time.monotonic() > deadline:
                if not quiet:
                    self.log(f"kubelet: {pod.describe()}: not unprepared within "
                             f"{PREPARE_DEADLINE:.0f}s: {why}")
                return why
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def remove_claim_pod(self, pod):
        """The pod's containers removed, then its claim unprepared and deleted, as the kubelet
        ends a pod. Raises KubeletError when a step failed (the pod is counted gone anyway)."""
        with self.lock:
            if pod.state not in ("running", "starting"):
                return
            pod.state, pod.changed = "removing", time.monotonic()
        rm = self.remove_containers(pod.containers)
        why = self.unprepare(pod)
        self.standin.call("delete_claim", namespace=pod.namespace, name=pod.name)
        self.set_state(pod, "gone", why or rm)
        if why or rm:
            raise KubeletError(f"{pod.describe()}: {why or rm}")

    # --- device plugin -------------------------------------------------------------------------
    def allocate_pod(self, units=None, gpus=None, script=None):
        """A pod whose container asks for `units` units of gpuplex.io/gpu-memory (default 1-4):
        the kubelet's device manager picks them among the healthy units no live pod holds
        (on `gpus` only, when given), asks GetPreferredAllocation, then Allocate; the container
        runs with the allocation's CDI device. Returns the running AllocPod; raises
        KubeletError (its units free again) when it cannot run."""
        if self.dp is None:
            raise KubeletError("the device plugin is not running (device_plugin=False)")
        n = units or self.rng.randint(1, 4)
        listed = self.units_listed
        if not listed or time.monotonic() - self.units_at > UNITS_FRESH:
            listed = self.list_units()
        with self.lock:
            held = {u for a in self.allocs if a.state in ("allocating", "starting", "running",
                                                          "removing") for u in a.units}
        free = [u["id"] for u in listed if u["health"] == "Healthy" and u["id"] not in held
                and (gpus is None or int(u["id"].split("-")[1]) in gpus)]
        with self.lock:
            self.seq += 1
            pod = AllocPod(f"alloc-{self.run_id}-{self.seq}", [])
        if len(free) < n:
            raise KubeletError(f"{pod.name}: {n} units asked, {len(free)} free on GPUs "
                               f"{gpus if gpus is not None else 'all'}")
        got = self.standin.call("preferred", available=free, must_include=[], size=n)
        if not got["ok"]:
            raise KubeletError(f"{pod.name}: GetPreferredAllocation: {got['error']}")
        chosen = got["units"][:n]
        if len(chosen) != n or any(u not in free for u in chosen):
            raise KubeletError(f"{pod.name}: GetPreferredAllocation chose {got['units']} of "
                               f"{n} free units")
        pod.units = chosen
        pod.gpu = int(chosen[0].split("-")[1])
        pod.memory = n * self.unit
        with self.lock:
            self.allocs.append(pod)
        self.set_state(pod, "allocating")
        got = self.standin.call("allocate", units=chosen)
        # A refusal for room releases nothing (the node checks the fit first); any other
        # failure may have come after the node released the allocations it supersedes.
        unfit = not got["ok"] and "cannot place" in got.get("error", "")
        with self.lock:
            # Any allocation that held one of these units is over now (or, when Allocate
            # failed otherwise than for room, perhaps over).
            # The same units again are the same allocation to the node: its vGPU goes on, for
            # this pod ("reused").
            for a in self.allocs:
                if (a is not pod and a.state in ("lingering", "uncertain") and not unfit
                        and set(a.units) & set(chosen)):
                    same = set(a.units) == set(chosen)
                    a.state = ("reused" if same else "superseded") if got["ok"] else "uncertain"
                    a.changed = time.monotonic()
        if not got["ok"]:
            self.set_state(pod, "failed", got["error"])
            raise KubeletError(f"{pod.describe()}: Allocate: {got['error']}")
        answer = got["containers"][0]
        cdi = answer.get("cdi_devices") or []
        if len(cdi) != 1 or not cdi[0].startswith("gpuplex.io/vgpu=units-"):
            self.set_state(pod, "failed", f"Allocate answered {answer}")
            raise KubeletError(f"{pod.describe()}: Allocate answered no allocation's CDI device "
                               f"(device_plugin_devices = \"cdi\"?): {answer}")
        pod.cdi_device = cdi[0]
        pod.key = cdi[0].split("=", 1)[1]
        self.set_state(pod, "starting")
        try:
            c = self.run_container(f"{pod.name}-0", pod.cdi_device,
                                   self.scripts(1, script)[0])
        except KubeletError as e:
            # The pod failed: its units are free again, its allocation lingers.
            self.set_state(pod, "lingering", str(e))
            raise
        with self.lock:
            pod.containers.append(c)
        self.set_state(pod, "running")
        return pod

    def release_pod(self, pod):
        """The pod's container removed: its units are free again in the kubelet's book, and
        its allocation lingers on the node until they are given again."""
        with self.lock:
            if pod.state not in ("running", "starting"):
                return
            pod.state, pod.changed = "removing", time.monotonic()
        rm = self.remove_containers(pod.containers)
        self.set_state(pod, "lingering", rm)
        if rm:
            raise KubeletError(f"{pod.describe()}: {rm}")

    # --- the fault -----------------------------------------------------------------------------
    def restart_plugin(self, mid_prepare=True, kind="dra", **pod_args):
        """kill -9 of the DRA driver (kind "dra") or the device plugin ("device-plugin") and
        its start again. With mid_prepare (the DRA driver), the API server turns slow (a
        claim's read waits 0.5-2 s), a claim pod is created in the background, and the driver
        is killed while its NodePrepareResources waits for the claim; the kubelet registers the
        new driver and the prepare is retried until the pod runs (or is refused). Returns what
        happened (a dict, kept in self.restarts)."""
        plugin = self.dra if kind == "dra" else self.dp
        if plugin is None:
            raise KubeletError(f"no {kind} plugin runs")
        record = {"kind": kind, "mid_prepare": False, "t": time.monotonic()}
        pod_box, thread = {}, None
        if mid_prepare and kind == "dra":
            delay = self.rng.uniform(0.5, 2.0)
            self.standin.call("api", claim_delay_ms=int(delay * 1000))

            def admit():
                try:
                    pod_box["pod"] = self.create_claim_pod(**pod_args)
                except KubeletError as e:
                    pod_box["error"] = str(e)

            before = len(self.claims)
            thread = threading.Thread(target=admit, name="admit-during-restart", daemon=True)
            thread.start()
            # The prepare is sent once the claim is in the API stand-in (its pod listed).
            for _ in range(100):
                with self.lock:
                    mine = self.claims[before:] if len(self.claims) > before else []
                if mine and mine[-1].attempts > 0:
                    break
                time.sleep(0.02)
            time.sleep(self.rng.uniform(0.15, max(0.2, delay - 0.15)))
            record["api_delay_s"] = round(delay, 2)
        old = plugin.proc.pid
        registered = len(self.standin.call("dp_registrations").get("registrations", []))
        plugin.kill9()
        self.log(f"kubelet: FAULT kill -9 of gpuplex-dra ({kind}, pid {old})"
                 + (" while a prepare waits for its claim" if thread else ""))
        if thread:
            self.standin.call("api", claim_delay_ms=0)
        time.sleep(self.rng.uniform(0.2, 1.0))
        plugin.start()
        if kind == "dra":
            self.register()
        else:
            got = self.standin.call("dp_registrations", at_least=registered + 1,
                                    timeout_ms=20000)
            if not got["ok"]:
                raise KubeletError(f"the device plugin did not register again: {got['error']}")
            self.units_at = 0.0  # ListAndWatch read again at the next allocation
        self.log(f"kubelet: gpuplex-dra ({kind}) started again as pid {plugin.proc.pid}, registered")
        if thread:
            thread.join(PREPARE_DEADLINE + 60)
            pod = pod_box.get("pod")
            record["mid_prepare"] = True
            record["pod"] = pod.name if pod else None
            record["prepare_attempts"] = pod.attempts if pod else None
            record["error"] = pod_box.get("error")
            # Killed while the first prepare was in flight: the first attempt failed.
            record["prepare_in_flight_at_kill"] = bool(pod and pod.attempts > 1)
            self.log("kubelet: the pod admitted during the restart: "
                     + (f"{pod.describe()} after {pod.attempts} prepare(s)" if pod
                        else f"not running: {pod_box.get('error')}"))
        with self.lock:
            self.restarts.append(record)
        return record

    # --- what is live, and the checks ----------------------------------------------------------
    def set_state(self, pod, state, error=None):
        with self.lock:
            pod.state, pod.changed = state, time.monotonic()
            if error:
                pod.error = error

    def busy(self):
        """Whether a pod is being created or removed now."""
        with self.lock:
            return any(p.state in ("preparing", "starting", "removing", "allocating")
                       for p in self.claims + self.allocs)

    def live(self):
        """What the node must hold for this kubelet now, as plain data:
        "claims": {uid: {pod, gpus, memory, containers: {id: pid}, state}} of claim pods being
        prepared, started, running or removed; "allocations": {key: {pod, units, gpu, memory,
        containers, state}} of allocation pods allocating, starting, running, removing or
        lingering; "gone": claim uids unprepared or refused, and "superseded": allocation keys
        that must have no vGPU (once SETTLE has passed, as "since" says); "containers": {id:
        what it belongs to} of every live container (the soak's own checks leave them to
        this module)."""
        with self.lock:
            claims, allocs = list(self.claims), list(self.allocs)
        out = {"claims": {}, "allocations": {}, "gone": {}, "superseded": {}, "containers": {}}
        now = time.monotonic()
        for c in claims:
            if c.state in ("preparing", "starting", "running", "removing"):
                out["claims"][c.uid] = {
                    "pod": c.name, "gpus": c.gpus, "memory": c.memory, "state": c.state,
                    "containers": {x.id: x.pid for x in c.containers},
                    "since": now - c.changed}
                for x in c.containers:
                    out["containers"][x.id] = {"kind": "claim", "pod": c.name, "claim": c.uid,
                                               "pid": x.pid, "gpus": c.gpus, "memory": c.memory}
            elif c.state in ("gone", "failed"):
                out["gone"][c.uid] = {"pod": c.name, "state": c.state, "since": now - c.changed}
        live_keys = set()
        for a in allocs:
            if a.state in ("allocating", "starting", "running", "removing", "lingering") and a.key:
                live_keys.add(a.key)
                out["allocations"][a.key] = {
                    "pod": a.name, "units": a.units, "gpu": a.gpu, "memory": a.memory,
                    "state": a.state, "containers": {x.id: x.pid for x in a.containers
                                                     if a.state != "lingering"},
                    "since": now - a.changed}
                if a.state != "lingering":
                    for x in a.containers:
                        out["containers"][x.id] = {"kind": "allocation", "pod": a.name,
                                                   "claim": a.key, "pid": x.pid,
                                                   "gpus": [a.gpu], "memory": a.memory}
        # An allocation whose fate is unknown keeps its key out of the judgement: the vGPU
        # that key names now may be its own.
        live_keys |= {a.key for a in allocs if a.state == "uncertain" and a.key}
        for a in allocs:
            if a.state == "superseded" and a.key not in live_keys:
                out["superseded"][a.key] = {"pod": a.name, "since": now - a.changed}
        return out

    def held_memory(self):
        """Bytes per GPU index the node holds for this kubelet's claims and allocations (those
        in a settled state), and whether some are in flight (then the count may differ)."""
        live = self.live()
        held, unsettled = {}, False
        for c in live["claims"].values():
            if c["state"] != "running":
                unsettled = True
                continue
            for g in c["gpus"]:
                held[g] = held.get(g, 0) + c["memory"]
        for a in live["allocations"].values():
            if a["state"] not in ("running", "lingering"):
                unsettled = True
                continue
            held[a["gpu"]] = held.get(a["gpu"], 0) + a["memory"]
        with self.lock:
            unsettled |= any(a.state == "uncertain" for a in self.allocs)
        return held, unsettled

    def check(self, status, settle=SETTLE):
        """The node's status against what this kubelet holds: a list of (kind, key, message),
        empty when they agree. Pods whose state changed within `settle` seconds, or are being
        changed, are not judged. Call it while the node service and the plugins are up."""
        problems = []
        live = self.live()
        by_claim = {}
        for s in status.get("containers", []):
            if s.get("claim"):
                by_claim.setdefault(s["claim"], []).append(("container", s))
        for r in status.get("reservations", []):
            if r.get("claim"):
                by_claim.setdefault(r["claim"], []).append(("reservation", r))
        attached = {s["id"]: s for s in status.get("containers", [])}

        def judge(key, what, gpus, memory, containers, label):
            entries = by_claim.get(key, [])
            vgpus = {e["vgpu"] for _k, e in entries}
            if not entries:
                problems.append(("vgpu-missing", key, f"{label} has no vGPU in the node's status"))
                return
            if len(vgpus) > 1:
                problems.append(("vgpu-duplicate", key, f"{label} has vGPUs {sorted(vgpus)}"))
            for _k, e in entries:
                if e["gpus"] != gpus or e["memory"] != [memory] * len(gpus):
                    problems.append(("vgpu-placement", key, f"{label}: its vGPU {e['vgpu']} holds "
                                     f"{e['memory']} bytes on GPUs {e['gpus']}, not {memory} on {gpus}"))
                    break
            for cid, pid in containers.items():
                runs = alive(pid)
                if runs and cid not in attached:
                    problems.append(("container-unattached", cid, f"{label}: container {cid[:12]} "
                                     f"(pid {pid}) runs but the node has it attached to nothing"))
                elif runs and attached[cid]["vgpu"] not in vgpus:
                    problems.append(("container-elsewhere", cid, f"{label}: container {cid[:12]} "
                                     f"is attached to {attached[cid]['vgpu']}, not {sorted(vgpus)}"))

        for uid, c in live["claims"].items():
            if c["state"] == "running" and c["since"] > settle:
                judge(uid, "claim", c["gpus"], c["memory"], c["containers"], f"claim pod {c['pod']}")
                spec = os.path.join(self.cdi_dir, f"gpuplex.io-vgpu-{uid}.json")
                if not os.path.exists(spec):
                    problems.append(("cdi-spec-missing", uid, f"claim pod {c['pod']}: no {spec}"))
        for key, a in live["allocations"].items():
            if a["state"] in ("running", "lingering") and a["since"] > settle:
                judge(key, "allocation", [a["gpu"]], a["memory"], a["containers"],
                      f"allocation pod {a['pod']} ({a['state']})")
        for uid, g in live["gone"].items():
            if g["since"] > settle and uid in by_claim:
                vg = sorted({e['vgpu'] for _k, e in by_claim[uid]})
                problems.append(("claim-leak", uid, f"claim pod {g['pod']} ({g['state']} "
                                 f"{g['since']:.0f}s ago) still has {vg}"))
            spec = os.path.join(self.cdi_dir, f"gpuplex.io-vgpu-{uid}.json")
            if g["since"] > settle and os.path.exists(spec):
                problems.append(("cdi-spec-leak", uid, f"claim pod {g['pod']}: {spec} outlives it"))
        for key, s in live["superseded"].items():
            if s["since"] > settle and key in by_claim:
                vg = sorted({e['vgpu'] for _k, e in by_claim[key]})
                problems.append(("allocation-leak", key, f"allocation of {s['pod']}: its units "
                                 f"were given again {s['since']:.0f}s ago, yet {vg} stays"))
        # Claims and allocations of this run the kubelet does not know (or no longer holds).
        with self.lock:
            uncertain = {a.key for a in self.allocs if a.state == "uncertain"}
            judging = {p.uid for p in self.claims if p.state in ("preparing", "removing")}
            judging |= {p.key for p in self.allocs if p.state in ("allocating", "removing")}
            # An allocation being made has no key yet: it is units-<its lowest unit>.
            judging |= {f"units-{u}" for p in self.allocs if p.state == "allocating"
                        for u in p.units}
        known = set(live["claims"]) | set(live["allocations"]) | set(live["gone"]) | uncertain | judging
        ours = {c.uid for c in self.claims}
        for key in by_claim:
            if key in known or (key not in ours and not key.startswith("units-")):
                continue
            if key.startswith("units-") and key in live["superseded"]:
                continue
            problems.append(("vgpu-unknown", key, f"{key} holds {sorted({e['vgpu'] for _k, e in by_claim[key]})} "
                             "and this kubelet has no pod for it"))
        return problems

    # --- the end -----------------------------------------------------------------------------------
    def drain(self):
        """Every pod of this kubelet removed (claims unprepared), then the lingering
        allocations released on the node socket as an operator would (no kubelet call ends
        one), and their CDI specs waited for (the device plugin removes them). Returns the
        problems found on the way, as check() does."""
        problems = []
        with self.lock:
            claims = [c for c in self.claims if c.state in ("running", "starting")]
            allocs = [a for a in self.allocs if a.state in ("running", "starting")]
        for c in claims:
            try:
                self.remove_claim_pod(c)
            except KubeletError as e:
                problems.append(("remove-failed", c.uid, str(e)))
        for a in allocs:
            try:
                self.release_pod(a)
            except KubeletError as e:
                problems.append(("remove-failed", a.key, str(e)))
        with self.lock:
            ending = [a for a in self.allocs if a.state in ("lingering", "uncertain") and a.key]
        for a in ending:
            try:
                reply = node_request(self.node_socket, json.dumps({"op": "release", "claim": a.key}))
            except (OSError, ValueError) as e:
                problems.append(("release-failed", a.key, f"release {a.key}: {e}"))
                continue
            if not reply.get("ok"):
                problems.append(("release-failed", a.key, f"release {a.key}: {reply.get('error')}"))
            if a.state == "lingering" and not reply.get("vgpu") and reply.get("ok"):
                problems.append(("allocation-lost", a.key, f"{a.describe()}: lingering, yet the "
                                 "node had no vGPU to release for it"))
            self.set_state(a, "ended")
        if self.dp is not None and self.dp.alive():
            keys = {a.key for a in ending}
            deadline = time.monotonic() + 10
            left = keys
            while time.monotonic() < deadline:
                left = {k for k in keys
                        if os.path.exists(os.path.join(self.cdi_dir, f"gpuplex.io-vgpu-{k}.json"))}
                if not left:
                    break
                time.sleep(0.1)
            for k in sorted(left):
                problems.append(("cdi-spec-leak", k, f"the CDI spec of released allocation {k} "
                                 "is still there 10 s after its release"))
        return problems

    def summary(self):
        """Counts for the soak's table."""
        with self.lock:
            count = lambda pods, s: sum(1 for p in pods if p.state == s)  # noqa: E731
            return {
                "claim_pods": len(self.claims), "claims_failed": count(self.claims, "failed"),
                "alloc_pods": len(self.allocs), "allocs_failed": count(self.allocs, "failed"),
                "superseded": count(self.allocs, "superseded"),
                "plugin_restarts": len(self.restarts),
                "restarts_mid_prepare": sum(1 for r in self.restarts
                                            if r.get("prepare_in_flight_at_kill")),
            }


def device_plugin_config(text):
    """The node's gpuplex.toml with `[kubernetes]` set for the device plugin with CDI devices
    (any [kubernetes] table it had is replaced)."""
    out, skipping = [], False
    for line in text.splitlines():
        header = re.match(r"\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$", line)
        if header:
            skipping = header.group(1) == "kubernetes"
        if not skipping:
            out.append(line)
    out += ["[kubernetes]", 'plugin = "device-plugin"', 'device_plugin_devices = "cdi"', ""]
    return "\n".join(out)
