"""make soak: the seeded generator of containers, and what is known of each.

Every decision (start or remove, and each new container's kind, annotations, timings and the
part it runs through: podman.py, containerd.py) is drawn from one `random.Random(seed)`, so a
seed replays the same decisions in the same order; when each lands depends on the machine's
timing.
"""
import os
import re
import time

GiB = 1 << 30
MiB = 1 << 20
GPU_MEMORY = 16 * GiB  # each fake GPU's (soak.sh's config)
SLICE = 0.2  # seconds: the config's slice

# Demands: the container's command in busybox sh.
BUSY = "while :; do :; done"
IDLE = "sleep 1000000"


def bursty(on, off):
    """Short busy spells (a busy child killed after `on` s) and sleeps of `off` s, for ever."""
    return (f"while :; do sh -c '{BUSY}' & p=$!; sleep {on}; kill $p; wait $p; "
            f"sleep {off}; done")


def finite(seconds):
    """Busy for `seconds`, then the container exits by itself."""
    return f"sh -c '{BUSY}' & p=$!; sleep {seconds}; kill $p; wait $p; exit 0"


class Container:
    """One container of the run: what was asked, and what became of it."""

    def __init__(self, seq, rng, part):
        self.seq = seq
        self.name = f"soak-{seq}"
        self.part = part  # the runtime it runs through (podman.Podman, containerd.Containerd)
        self.id = None
        self.pid = None
        self.cgroups = []  # freezer files of its cgroup: v1 freezer.state and/or v2 cgroup.freeze
        self.state = "new"  # new, starting, live, exited, killed, removing, removed, failed
        self.started_at = None  # monotonic, when its start returned
        self.gone_at = None  # monotonic, when it was seen gone (exited or removed)
        self.frozen_up = 0.0  # seconds frozen in a row while the service ran
        self.frozen_reported = False
        self.freeze_bound = 0.0  # the largest bound of the freeze going on (checks.py)
        self.gpus_now = []  # its GPUs in the node's last status
        self.gpus_last = []  # its GPUs when the node's status last showed it
        self.vgpu_last = None  # its vGPU id in the node's last status
        r = rng.random()
        self.priority = "normal"
        if r < 0.10:
            self.priority = "low"
        elif r < 0.18:
            self.priority = "high"
        self.weight = rng.randint(1, 5)
        self.gpus = 2 if rng.random() < 0.05 else 1
        # Memory per GPU: mostly small; some large that may not fit; some that never fit.
        r = rng.random()
        if r < 0.05:
            self.memory, self.mem_bytes = rng.choice([("20Gi", 20 * GiB), ("32Gi", 32 * GiB)])
        elif r < 0.15:
            gib = rng.choice([6, 8, 12])
            self.memory, self.mem_bytes = f"{gib}Gi", gib * GiB
        else:
            self.memory, self.mem_bytes = rng.choice(
                [("512Mi", 512 * MiB), ("1Gi", GiB), ("1536Mi", 1536 * MiB), ("2Gi", 2 * GiB),
                 ("3Gi", 3 * GiB)])
        self.annotated = rng.random() >= 0.05  # a few ask for nothing: gpuplex leaves them alone
        self.never_fits = self.annotated and self.mem_bytes > GPU_MEMORY  # (nothing asked fits)
        # The demand. High priority is never frozen and freezes its neighbours while it works,
        # so its work comes in short bursts (else it would starve them, by design).
        r = rng.random()
        if self.priority == "high":
            self.kind, on, off = "bursty", rng.choice([0.2, 0.5, 1]), rng.choice([2, 3, 5])
            self.script = bursty(on, off)
        elif r < 0.40:
            self.kind, self.script = "busy", BUSY
        elif r < 0.65:
            self.kind, self.script = "idle", IDLE
        elif r < 0.90:
            self.kind = "bursty"
            self.script = bursty(rng.choice([0.1, 0.3, 0.5, 1, 2]), rng.choice([0.5, 1, 2, 4]))
        else:
            self.kind = "finite"
            self.script = finite(rng.randint(5, 60))

    def annotations(self):
        """The gpuplex.io/ annotations it is started with: {key: value}."""
        if not self.annotated:
            return {}
        a = {"gpuplex.io/gpu-memory": self.memory, "gpuplex.io/weight": str(self.weight)}
        if self.priority != "normal":
            a["gpuplex.io/priority"] = self.priority
        if self.gpus != 1:
            a["gpuplex.io/gpus"] = str(self.gpus)
        return a

    def describe(self):
        ask = (f"{self.memory}x{self.gpus} w={self.weight} {self.priority}"
               if self.annotated else "no vGPU")
        return f"{self.name} ({self.part.name}, {self.kind}, {ask})"

    def alive(self):
        """Its init still runs (and is still in its cgroup, whose last component is its id or
        ends with -ID: a pid is not reused unseen)."""
        try:
            with open(f"/proc/{self.pid}/cgroup") as f:
                leaves = {line.rstrip("/").rsplit("/", 1)[-1] for line in f.read().splitlines()}
            with open(f"/proc/{self.pid}/stat") as f:
                running = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, TypeError):
            return False
        return running and any(x == self.id or x.endswith("-" + self.id) for x in leaves)

    def frozen(self):
        """Whether its cgroup is frozen (or freezing) now, read from the kernel's files."""
        for path in self.cgroups:
            try:
                with open(path) as f:
                    v = f.read().strip()
            except OSError:
                continue
            if v in ("FROZEN", "FREEZING", "1"):
                return True
        return False


def cgroup_mounts():
    """Mount points of the v1 freezer hierarchy and of cgroup2, from /proc/self/mountinfo."""
    freezer = unified = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _src, opts = right.split()[:3]
            point = left.split()[4]
            if fstype == "cgroup" and "freezer" in opts.split(","):
                freezer = point
            elif fstype == "cgroup2":
                unified = point
    return freezer, unified


class Workload:
    """Starts and removes containers through its parts, at seeded random. `parts` is a list of
    (part, share): each new container runs through a part drawn by share; the first part takes
    what the others' shares leave."""

    def __init__(self, run, parts, rng, lo, hi, mean_gap):
        self.run, self.parts, self.rng = run, parts, rng
        self.lo, self.hi, self.mean_gap = lo, hi, mean_gap
        self.freezer, self.unified = cgroup_mounts()
        self.containers = []  # every container of the run, in order
        self.quit = False
        self.started = self.removed = self.exited = self.attempts = 0
        self.by_part = {p.name: 0 for p, _ in parts}  # containers started, per part
        self.refusals = {}  # reason: count
        self.inflight = None  # the container being started or removed now
        self.refused_vgpus = []  # (monotonic time, vGPU id named by a refusal): must be gone
        for part, _share in parts:
            part.workload = self  # a part's faults and checks look at its containers

    def live(self):
        return [c for c in self.containers if c.state == "live"]

    def pick_part(self):
        r, acc = self.rng.random(), 0.0
        for part, share in self.parts[1:]:
            acc += share
            if r < acc:
                return part
        return self.parts[0][0]

    def loop(self):
        """The generator: fill to the low mark, then start or remove at random, until quit."""
        seq = 0
        while not self.quit:
            self.reap()
            n = len(self.live())
            if n < self.lo:
                action = "start"
            elif n >= self.hi:
                action = "remove"
            else:
                action = "start" if self.rng.random() < 0.5 else "remove"
            if action == "start":
                seq += 1
                part = self.pick_part()
                self.start(Container(seq, self.rng, part))
            else:
                self.remove(self.rng.choice(self.live()), self.rng.random() < 0.3)
            if n >= self.lo:
                time.sleep(self.rng.expovariate(1.0 / self.mean_gap))

    def start(self, c):
        self.containers.append(c)
        self.inflight, c.state = c, "starting"
        self.attempts += 1
        t0 = self.run.now()
        ok, line = c.part.run_container(c)
        self.inflight = None
        t1 = self.run.now()
        if not ok:
            c.state, c.gone_at = "failed", time.monotonic()
            if c.never_fits:
                reason = "does not fit any GPU (expected)"
            elif self.run.fault_near(t0, t1):
                reason = "during a fault"
            elif "fit" in line or "free" in line:
                reason = "no GPU has room now"
            else:
                self.run.violation("start-failed", f"{c.describe()}: {c.part.name} run failed: {line}")
                return
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            self.refused_vgpus += [(time.monotonic(), v) for v in set(re.findall(r"vgpu-\d+", line))]
            self.run.log(f"refused {c.describe()}: {reason}: {line}")
            return
        if c.pid:
            self.find_cgroups(c)
        c.started_at, c.state = time.monotonic(), "live"
        self.started += 1
        self.by_part[c.part.name] += 1
        if c.never_fits:
            self.run.violation("oversize-admitted", f"{c.describe()} was admitted on {GPU_MEMORY >> 30}Gi GPUs")
        self.run.log(f"started {c.describe()} {c.id[:12]} in {t1 - t0:.1f}s")

    def find_cgroups(self, c):
        """Its freezer files, from /proc/PID/cgroup (v1 freezer line, v2 line)."""
        try:
            with open(f"/proc/{c.pid}/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for line in lines:
            _h, ctrls, path = line.split(":", 2)
            if "freezer" in ctrls.split(",") and self.freezer:
                c.cgroups.append(f"{self.freezer}{path}/freezer.state")
            elif ctrls == "" and self.unified and path != "/":
                c.cgroups.append(f"{self.unified}{path}/cgroup.freeze")
        self.run.append_file("cgroups.txt", "".join(os.path.dirname(p) + "\n" for p in c.cgroups))

    def remove(self, c, graceful):
        """Stopped gracefully (SIGTERM, 2 s, then SIGKILL) or killed, then removed."""
        self.inflight, c.state = c, "removing"
        t0 = self.run.now()
        ok, why = c.part.remove(c, graceful)
        self.inflight = None
        c.state = "removed"
        c.gone_at = c.gone_at or time.monotonic()
        self.removed += 1
        if not ok and self.run.fault_near(t0, self.run.now()):
            self.run.log(f"removing {c.describe()} {c.id[:12]} failed during a fault: {why}")
        elif not ok:
            self.run.violation("remove-failed", f"{c.describe()} {c.id[:12]}: {why}")
        else:
            self.run.log(f"removed {c.describe()} {c.id[:12]}" + (" (stop, then rm)" if graceful else ""))

    def reap(self):
        """Containers whose init ended: noted as exited, then removed. (A container whose shim
        a fault killed is `killed` until its part has checked what containerd cleaned up.)"""
        for c in self.live():
            if not c.alive():
                c.state, c.gone_at = "exited", time.monotonic()
                self.exited += 1
                self.run.log(f"{c.describe()} {c.id[:12]} exited")
        for c in [c for c in self.containers if c.state == "exited"]:
            c.part.remove_gone(c)
            c.state = "removed"

    def remove_all(self):
        """The end: every container removed, by each part."""
        now = time.monotonic()
        for c in self.containers:
            if c.state in ("live", "exited", "killed", "starting", "removing"):
                c.state, c.gone_at = "removed", c.gone_at or now
        for part, _share in self.parts:
            for problem in part.remove_all():
                self.run.violation("remove-failed", problem)
