"""make soak: the invariants, checked every second while the run goes and once more at its end.

1. frozen: no container frozen longer than its neighbours' windows allow while the service runs
   (`bound`), a high-priority or unannotated one not at all; none frozen one second after the
   service is gone (node.Service.gone_check). The freezer files are read 10 times a second.
2. vgpus: every live container that asked for a vGPU has exactly one in the node's status,
   every vGPU there belongs to a live container, no reservation lingers (after a settle time).
3. memory: each GPU's reserved memory (capacity - unreserved) equals the sum of its live
   containers' requests (and of the reservations of starts in flight).
4. resources: the service's fds, threads and RSS flat over each long enough lifetime (their
   trend over time, the numbers of containers, of its connections and of the containers'
   processes held apart: a containerd shim keeps its pooled connections, a thread and an fd
   each in the service, until the service lets them go after a minute idle); its fds counted
   without the /proc/PID/stat and status files its cgroup reader keeps open for the processes
   it reads (bursty ones come and go; the reader drops a dead one's at its container's next
   read), which may never pass KEPT_BUDGET; and its connections never more than POOL_SIZE per
   live shim or kubelet plugin, plus CONNS_SLACK for the hooks and this checker.
5. latency: a status request on the node socket answered within 100 ms while the 1-minute load
   average is under 2.
The parts add their own (each part's tick(), called here every second): containerd.py's, after
its restart and after a shim's kill -9. A container whose shim was killed is gone: its vGPU must
go within GONE_SETTLE, as any gone container's (2).
"""
import collections
import json
import os
import statistics
import time

from node import request

SETTLE = 3.0  # seconds after a start, a fault or a restart before vGPUs must match
GONE_SETTLE = 6.0  # seconds a vGPU may outlive its container (exit seen, poststop hook)
RESERVATION_MAX = 20.0  # seconds a reservation may wait for its container
RESERVATION_TTL = 60.0  # gpuplex.toml's reservation_ttl (its default): when a reservation lapses,
# which is the way back for one whose holder's release a fault lost (the service was down when
# a failed start let go of it), so a reservation with a fault near may live that long
LATENCY_MAX = 0.100
LOAD_MAX = 2.0
WARMUP = 20.0  # seconds of a service lifetime before its resources count
LIFETIME_MIN = 90.0  # a lifetime this long has its start and end compared (inv. 4)
WINDOW = 30.0  # seconds at each end of a lifetime whose samples are compared
TOLERANCE = 0.10
POOL_SIZE = 4  # connections a shim may keep open (wire/src/socket/pool.rs)
CONNS_SLACK = 8  # connections of the hooks, gpuplexctl and this checker at any moment
KEPT_BUDGET = 256  # files the service's cgroup reader keeps open at most (cgroup/src/reader.rs)
EVIDENCE_STATUSES = 40  # the last statuses (one a second) written beside a frozen-too-long


def bound(c, status, slice_s):
    """How long c may stay frozen: two rounds of its GPUs' other windows, plus margins, with
    the neighbours of `status`. A freeze is held to the largest bound seen while it lasts
    (check_frozen): a neighbour that left during it had its windows in it."""
    mine = set(c.gpus_now)
    others = [o for o in status["containers"] if o["id"] != c.id and mine & set(o["gpus"])]
    rounds = sum(o["weight"] * slice_s for o in others if o["priority"] == "normal")
    highs = sum(1 for o in others if o["priority"] == "high")
    return max(10.0, 5.0 + 2 * rounds + 3.0 * highs)


class Checker:
    def __init__(self, run, svc, work, slice_s):
        self.run, self.svc, self.work, self.slice = run, svc, work, slice_s
        self.status = None  # the last status the service answered
        self.recent = collections.deque(maxlen=EVIDENCE_STATUSES)  # (run time, status)
        self.latencies = []
        self.slow_under_load = 0  # answers over 100 ms not counted (load average >= 2)
        self.reported = set()  # (kind, key) of violations already printed, once each
        self.reservation_seen = {}  # vgpu id: first time seen
        self.unknown_seen = {}  # container id of no container of ours: first time seen
        self.mismatched = set()  # GPUs whose reserved memory is wrong now (printed once)
        self.longest_freeze = {}  # priority: (seconds, container)
        self.claim_check = None  # pods.Pods.check, when the kubelet's pods run
        self.plugin_clients = 0  # the DRA driver and the device plugin, when the pods run
        self.quit = False

    def once(self, kind, key, msg):
        if (kind, key) not in self.reported:
            self.reported.add((kind, key))
            self.run.violation(kind, msg)

    # --- 1. the freezer, sampled 10 times a second ---------------------------------------
    def sample_freezer(self):
        last = time.monotonic()
        while not self.quit:
            time.sleep(0.1)
            now = time.monotonic()
            dt, last = now - last, now
            running = self.svc.up and not self.svc.stopped
            for c in list(self.work.containers):
                if c.state != "live" or not c.cgroups:
                    continue
                if not c.frozen():
                    c.frozen_up, c.frozen_reported, c.freeze_bound = 0.0, False, 0.0
                elif running:
                    c.frozen_up += dt
                    if c.frozen_up > self.longest_freeze.get(c.priority, (0,))[0]:
                        self.longest_freeze[c.priority] = (c.frozen_up, c.describe())

    def frozen_now(self):
        """The live containers frozen now (what node.Service.gone_check asks)."""
        return [f"{c.describe()} {c.id[:12]}" for c in list(self.work.containers)
                if c.state in ("live", "removing") and c.cgroups and c.frozen()]

    def check_frozen(self, status):
        self.run.count_check("frozen")
        for c in self.work.live():
            if c.frozen_up <= 0 or c.frozen_reported:
                continue
            who = f"{c.describe()} {c.id[:12]}"
            if not c.annotated:
                c.frozen_reported = True
                self.run.violation("frozen-unmanaged", f"{who} asked for no vGPU yet is frozen")
            elif c.priority == "high" and c.frozen_up > 0.5:
                c.frozen_reported = True
                self.run.violation("frozen-high", f"{who} is high priority yet frozen for {c.frozen_up:.1f}s")
            elif c.priority == "normal" and status is not None:
                limit = max(c.freeze_bound, bound(c, status, self.slice))
                c.freeze_bound = limit
                if c.frozen_up > limit:
                    c.frozen_reported = True
                    evidence = self.evidence(c, limit)
                    self.run.violation("frozen-too-long", f"{who} frozen {c.frozen_up:.1f}s in a row "
                                       f"(its GPUs' windows allow {limit:.1f}s; {evidence})")

    def evidence(self, c, limit):
        """Writes what a replay needs beside the report: the node's window events (all it
        keeps), the last statuses and the container; returns the file's name."""
        name = f"frozen-{c.name}-{self.run.now():.0f}s.json"
        doc = {"container": c.describe(), "id": c.id, "gpus": c.gpus_now, "vgpu": c.vgpu_last,
               "frozen_s": c.frozen_up, "bound_s": limit, "at_s": self.run.now(),
               "wall": time.time(), "statuses": list(self.recent)}
        try:
            doc["events"] = request(self.svc.socket, '{"op":"events","since":0}')[0].get("events")
        except (OSError, ValueError) as e:
            doc["events"] = f"not read: {e}"
        with open(os.path.join(self.run.out, name), "w") as f:
            json.dump(doc, f)
        return f"evidence in {name}"

    # --- 2 and 3. vGPUs and memory ---------------------------------------------------------
    def check_vgpus(self, status, final=False):
        now = time.monotonic()
        self.run.count_check("vgpus")
        by_id = {}
        for s in status["containers"]:
            if not s.get("claim"):  # a claim's or an allocation's: the kubelet's (pods.py)
                by_id.setdefault(s["id"], []).append(s)
        known = {c.id: c for c in list(self.work.containers) if c.id}
        for c in self.work.live():
            if not c.annotated or (now - c.started_at < SETTLE and not final):
                continue
            n = len(by_id.get(c.id, []))
            if n == 0 and c.alive():
                note = self.torn_note(c)
                kind = "vgpu-lost-with-torn-record" if "truncated" in note else "vgpu-missing"
                self.once(kind, c.id, f"{c.describe()} {c.id[:12]} is live, asked for a "
                          f"vGPU and has none in the node's status{note}")
            elif n > 1:
                self.once("vgpu-duplicate", c.id, f"{c.describe()} {c.id[:12]} has {n} vGPUs")
        for cid, entries in by_id.items():
            c = known.get(cid)
            vg = ", ".join(e["vgpu"] for e in entries)
            if c is None:
                # A start in flight (podman run has not answered) or a failed one (its vGPU
                # must go with it).
                first = self.unknown_seen.setdefault(cid, now)
                if final or now - first > GONE_SETTLE + RESERVATION_MAX:
                    self.once("vgpu-unknown", cid, f"{vg} belongs to {cid[:12]}, no live container "
                              f"of this run, for {now - first:.0f}s")
            elif not c.annotated:
                self.once("vgpu-unrequested", cid, f"{c.describe()} asked for nothing yet has {vg}")
            elif c.state != "live" and c.gone_at and (final or now - c.gone_at > GONE_SETTLE):
                self.once("vgpu-leak", cid, f"{vg} of {c.describe()} {cid[:12]} outlives it "
                          f"({c.state} {now - c.gone_at:.0f}s ago)")
            elif c.state == "live" and any(e["memory"] != [c.mem_bytes] * c.gpus for e in entries):
                self.once("memory-mismatch", cid, f"{c.describe()}: its vGPU holds {entries[0]['memory']} bytes")
        seen = {r["vgpu"] for r in status["reservations"]}
        for r in status["reservations"]:
            if r.get("claim"):  # pinned for a claim or an allocation: the kubelet's (pods.py)
                continue
            first = self.reservation_seen.setdefault(r["vgpu"], now)
            seen_at = self.run.now() - (now - first)  # when first seen, on the run's clock
            orphan = self.run.fault_near(seen_at - RESERVATION_TTL, self.run.now())
            limit = RESERVATION_TTL + 5 if orphan else RESERVATION_MAX
            if now - first > limit or (final and self.work.inflight is None and not orphan):
                self.once("reservation-leak", r["vgpu"], f"reservation {r['vgpu']} on GPUs {r['gpus']} "
                          f"({r['memory']} bytes) unattached for {now - first:.0f}s")
        self.reservation_seen = {k: v for k, v in self.reservation_seen.items() if k in seen}
        # A refused start's vGPU (named in its error) is released with the refusal, and the
        # node never gives the id a refusal named to another vGPU.
        owner = {s["vgpu"] for s in status["containers"]}
        due = [x for x in self.work.refused_vgpus if final or now - x[0] > SETTLE]
        for t, vgpu in due:
            self.run.count_check("refusal-released")
            if vgpu in seen or vgpu in owner:
                self.once("refusal-left-vgpu", vgpu, f"{vgpu} is held {now - t:.0f}s after a "
                          "refusal named it")
            self.work.refused_vgpus.remove((t, vgpu))
        self.unknown_seen = {k: v for k, v in self.unknown_seen.items() if k in by_id}
        # 3. memory: per GPU, what the node holds against what the live containers asked.
        self.run.count_check("memory")
        for gpu in status["gpus"]:
            g = gpu["index"]
            held = gpu["capacity"] - gpu["unreserved"]
            asked, settled = 0, True
            # A claim's vGPU, shared by its pod's containers, counts once (the kubelet checks
            # that it holds what the claim asked).
            claimed = {s["vgpu"]: s for s in status["containers"] if s.get("claim") and g in s["gpus"]}
            asked += sum(s["memory"][s["gpus"].index(g)] for s in claimed.values())
            for s in status["containers"]:
                if g in s["gpus"] and not s.get("claim"):
                    c = known.get(s["id"])
                    if c is None or c.state != "live":
                        settled = False
                    else:
                        asked += c.mem_bytes
            asked += sum(r["memory"][r["gpus"].index(g)] for r in status["reservations"] if g in r["gpus"])
            # A live container that lost its vGPU still holds its entitlement, in the rule.
            lost = sum(c.mem_bytes for c in self.work.live() if c.annotated and c.id not in by_id
                       and g in c.gpus_last and c.alive())
            asked += lost
            if held == asked:
                if settled:
                    self.mismatched.discard(g)
            elif (settled or final) and g not in self.mismatched:
                self.mismatched.add(g)
                why = f" ({lost} of them by live containers that lost their vGPU)" if lost else ""
                self.run.violation("reserved-mismatch", f"GPU {g}: {held} bytes reserved, its live "
                                   f"containers and reservations asked {asked}{why}")

    def torn_note(self, c):
        for t, name, vgpu in getattr(self.run, "truncated", []):
            if c.vgpu_last == vgpu:
                return f" (its record {name} was truncated at +{t:.0f}s)"
        return f" (it had {c.vgpu_last})" if c.vgpu_last else ""

    # --- the loop: every second --------------------------------------------------------------
    def tick(self):
        svc = self.svc
        settled = (svc.up and not svc.stopped and time.monotonic() - svc.up_since > SETTLE
                   and self.run.quiet_for() > SETTLE)
        status = None
        if svc.up and not svc.stopped:
            t0 = self.run.now()
            try:
                reply, took = request(svc.socket, '{"op":"status"}')
                status = reply.get("status")
            except (OSError, ValueError) as e:
                reply, took = None, None
                if settled and not self.run.fault_near(t0, self.run.now(), grace=0):
                    self.run.violation("socket-error", f"status request: {e}")
            # A request a fault overlapped is not the socket's latency.
            if took is not None and not self.run.fault_near(t0, self.run.now(), grace=0):
                self.latency(took, settled)
        if status is not None:
            self.status = status
            self.recent.append((round(self.run.now(), 2), status))
            # The kubelet's plugins keep a pool of connections each, as a shim does.
            clients = sum(part.clients() for part, _ in self.work.parts) + self.plugin_clients
            sample = svc.sample(len(status["containers"]), clients, self.processes())
            self.check_connections(sample)
            by_id = {}
            for s in status["containers"]:
                by_id.setdefault(s["id"], []).append(s)
            for c in self.work.live():
                mine = by_id.get(c.id, [])
                c.gpus_now = [g for s in mine for g in s["gpus"]]
                if mine:
                    c.vgpu_last, c.gpus_last = mine[0]["vgpu"], c.gpus_now
        self.check_frozen(status or self.status)
        if status is not None and settled:
            self.check_vgpus(status)
            if self.claim_check is not None:
                self.claim_check(status)
        for part, _share in self.work.parts:
            part.tick()

    def processes(self):
        """How many processes the live containers have (their freezer cgroups' cgroup.procs)."""
        n = 0
        for c in self.work.live():
            for path in c.cgroups[:1]:
                try:
                    with open(os.path.join(os.path.dirname(path), "cgroup.procs")) as f:
                        n += len(f.read().split())
                except OSError:
                    pass
        return n

    def check_connections(self, sample):
        """A connection of the service's has a live client: at most POOL_SIZE per shim or kubelet plugin."""
        if sample is None or sample[0] < WARMUP:
            return
        conns, clients, kept = sample[5], sample[6], sample[11]
        self.run.count_check("connections")
        if kept > KEPT_BUDGET:
            self.once("kept-files", self.svc.pid, f"service pid {self.svc.pid} keeps {kept} /proc "
                      f"files open (its cgroup reader keeps {KEPT_BUDGET} at most)")
        if conns > POOL_SIZE * clients + CONNS_SLACK:
            self.once("connections", self.svc.pid, f"service pid {self.svc.pid} holds {conns} "
                      f"connections with {clients} shims and plugins alive (at most {POOL_SIZE} each, "
                      f"{CONNS_SLACK} more for the hooks)")

    def latency(self, took, settled):
        if not settled:
            return
        self.latencies.append(took)
        self.run.count_check("latency")
        if took > LATENCY_MAX:
            load = os.getloadavg()[0]
            if load < LOAD_MAX:
                self.run.violation("socket-latency", f"status answered in {took * 1000:.0f} ms "
                                   f"(load average {load:.2f})")
            else:
                self.slow_under_load += 1

    def loop(self):
        while not self.quit:
            t = time.monotonic()
            self.tick()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))

    # --- 4. resources: per service lifetime -------------------------------------------------
    def check_resources(self):
        """Each lifetime of LIFETIME_MIN seconds or more, after its WARMUP: the trend of its fds,
        threads and RSS over time, the numbers of containers, connections and processes held apart
        (fds and threads follow them, and they come and go), may not grow more than 10% of its
        median over the lifetime (a drop is no leak)."""
        compared = []
        for life in self.svc.lifetimes:
            s = [x for x in life["samples"] if x[0] >= WARMUP]
            if len(s) < 10 or s[-1][0] < LIFETIME_MIN:
                continue
            self.run.count_check("resources")
            span = s[-1][0] - s[0][0]
            row = {"pid": life["pid"], "seconds": round(s[-1][0]), "samples": len(s)}
            held = [[x[1] for x in s], [x[5] for x in s], [x[10] for x in s]]
            s = [x[:2] + (x[2] - x[11],) + x[3:] for x in s]  # fds without the /proc files kept
            grew = lambda i: trend(held, [x[0] for x in s], [x[i] for x in s]) * span  # noqa: E731
            of_fds = ", ".join(f"{k} {grew(i):+.1f}" for i, k in
                               [(5, "sockets"), (7, "pidfds"), (8, "cgroup files"), (9, "other"),
                                (11, "/proc files, not counted")])
            for i, (name, slack) in enumerate([("fds", 2), ("threads", 2), ("rss_kb", 2048)], 2):
                base = statistics.median(x[i] for x in s)
                growth = grew(i)
                row[name] = {"median": base, "growth": round(growth, 1)}
                if growth > base * TOLERANCE + slack:
                    self.run.violation("resources", f"service pid {life['pid']}: {name} grew by "
                                       f"{growth:.0f} over {span:.0f}s (median {base:.0f}), "
                                       "the numbers of containers, connections and processes held "
                                       "apart"
                                       + (f" (of the fds: {of_fds})" if name == "fds" else ""))
            row["fds_by_kind_growth"] = of_fds
            compared.append(row)
        return compared

    def latency_summary(self):
        if not self.latencies:
            return {"n": 0}
        xs = sorted(self.latencies)
        q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1000  # noqa: E731
        return {"n": len(xs), "p50_ms": round(q(0.50), 2), "p99_ms": round(q(0.99), 2),
                "max_ms": round(xs[-1] * 1000, 2), "slow_under_load": self.slow_under_load}


def residuals(covariates, ys):
    """ys less their least-squares fit on a constant and the covariates (lists like ys), by
    Gram-Schmidt: each covariate centred and made orthogonal to those before it."""
    def centred(v):
        m = statistics.fmean(v)
        return [x - m for x in v]

    def minus_projection(v, b):
        bb = sum(x * x for x in b)
        k = sum(x * y for x, y in zip(v, b)) / bb
        return [x - k * y for x, y in zip(v, b)]

    basis = []
    for cov in covariates:
        c = centred(cov)
        for b in basis:
            c = minus_projection(c, b)
        if sum(x * x for x in c) > 1e-9:
            basis.append(c)
    out = centred(ys)
    for b in basis:
        out = minus_projection(out, b)
    return out


def trend(held, t, v):
    """The slope of v over t with the covariates `held` apart (v ~ a + B held + c t; returns
    c), by regressing both v and t on them first (Frisch-Waugh)."""
    rv, rt = residuals(held, v), residuals(held, t)
    den = sum(x * x for x in rt)
    return sum(a * b for a, b in zip(rv, rt)) / den if den else 0.0
