"""make soak: the run itself (tests/soak/soak.sh sets the machine up and calls this).

Threads: the service's supervisor (node.Service), the generator (workload.Workload), the faults
(node.Faults), the freezer sampler and the one-second checker (checks.Checker), and the parts'
own (containerd's supervisor), and the kubelet's pods (pods.Pods: claims and device-plugin
allocations through the real DRA driver and device plugin, a generator of their own). The parts
are the runtimes containers run through (`parts()`: podman.Podman, containerd.Containerd); each
brings its faults and checks. At the end the generators and the faults stop, the run settles
and is checked once more, every pod and container is removed and the node must hold nothing, the parts and the service are stopped, and the summary
is printed (a markdown table) and written as JSON. Exit status 1 on any violation.
"""
import argparse
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from datetime import datetime, timezone

import checks
from clock import ClockStep
import node
from containerd import Containerd
from podman import Podman
from pods import Pods, start_thread
from workload import Workload


class Run:
    """What every part shares: the clock, the log, the fault windows, checks and violations."""

    def __init__(self, seed, work, out):
        self.seed, self.work, self.out = seed, work, out
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.windows = []  # [kind, start, end or None]: faults and the service's downtimes
        self.checks = {}
        self.violations = []
        self.logfile = open(os.path.join(out, "soak.log"), "a", buffering=1)
        self.truncated = []

    def now(self):
        return time.monotonic() - self.t0

    def log(self, msg):
        line = f"[+{self.now():7.1f}s] {msg}"
        with self.lock:
            print(line, flush=True)
            self.logfile.write(line + "\n")

    def violation(self, kind, msg):
        utc = datetime.now(timezone.utc).strftime("%H:%M:%S")
        with self.lock:
            self.violations.append({"kind": kind, "t": round(self.now(), 1), "utc": utc, "what": msg})
        self.log(f"VIOLATION {kind} (seed {self.seed}, +{self.now():.1f}s, {utc} UTC): {msg}")

    def count_check(self, kind):
        with self.lock:
            self.checks[kind] = self.checks.get(kind, 0) + 1

    def fault_begin(self, kind):
        """A fault (or a downtime) begins: returns its start, which fault_end names."""
        with self.lock:
            start = self.now()
            self.windows.append([kind, start, None])
            return start

    def fault_end(self, kind, start):
        with self.lock:
            for w in self.windows:
                if w[0] == kind and w[1] == start and w[2] is None:
                    w[2] = self.now()

    def fault_active(self):
        with self.lock:
            return any(w[2] is None for w in self.windows)

    def fault_near(self, t0, t1, grace=3.0):
        """Whether a fault or a downtime overlapped [t0, t1] (give or take `grace` seconds)."""
        now = self.now()
        with self.lock:
            return any(s - 1 <= t1 and (e if e is not None else now) + grace >= t0
                       for _k, s, e in self.windows)

    def quiet_for(self):
        """Seconds since the last fault or downtime ended (0 while one lasts)."""
        now = self.now()
        with self.lock:
            if any(w[2] is None for w in self.windows):
                return 0.0
            return min((now - w[2] for w in self.windows), default=float("inf"))

    def write_file(self, name, text):
        with open(os.path.join(self.work, name), "w") as f:
            f.write(text)

    def append_file(self, name, text):
        with open(os.path.join(self.work, name), "a") as f:
            f.write(text)


def arguments():
    p = argparse.ArgumentParser(description="make soak's run (see tests/soak/soak.sh)")
    for name in ("work", "bin", "podman-dir", "rootfs", "out", "replay", "cpus"):
        p.add_argument("--" + name, required=True)
    p.add_argument("--containerd", type=float, required=True, help="share of containerd's containers")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--min", type=int, required=True)
    p.add_argument("--max", type=int, required=True)
    p.add_argument("--fault-every", type=float, required=True)
    p.add_argument("--churn", type=float, required=True)
    p.add_argument("--pods", required=True, help="LO-HI kubelet pods kept alive (0-0: none)")
    p.add_argument("--run-id", required=True, help="8 hex digits in the kubelet's names")
    return p.parse_args()


def main():
    a = arguments()
    run = Run(a.seed, a.work, a.out)
    seconds = a.minutes * 60
    run.log(f"make soak: seed {a.seed}, {a.minutes:g} min, {a.min}-{a.max} containers on 4 fake "
            f"GPUs of 16Gi, a fault every {a.fault_every:g}s on average")
    run.log(f"replay: {a.replay}")
    rng_work, rng_fault = random.Random(a.seed), random.Random(a.seed * 1_000_003 + 7)
    parts = make_parts(run, a)
    extra = {k: f for part, _ in parts for k, f in part.fault_kinds.items()}
    pods = make_pods(run, a, parts[0][0].cmd)
    if pods is not None:
        extra |= pods.fault_kinds
    schedule = node.plan(rng_fault, seconds, a.fault_every, node.KINDS + list(extra) + ["clock-step"])
    run.log("parts: " + ", ".join(f"{p.name} {share:.0%}" for p, share in shares(parts)))
    run.log(f"faults planned: {len(schedule)}; the first: "
            + (", ".join(f"+{t:g}s {k}" for t, k in schedule[:len(node.KINDS) + len(extra) + 1]) or "none"))
    work = Workload(run, parts, rng_work, a.min, a.max, a.churn)
    checker = None
    svc = node.Service(run, os.path.join(a.bin, "containerd-shim-gpuplex-v1"),
                       os.path.join(a.work, "gpuplex.toml"), os.path.join(a.work, "gpuplex.sock"),
                       os.path.join(a.out, "service.log"), os.path.join(a.work, "state"),
                       lambda: checker.frozen_now())
    checker = checks.Checker(run, svc, work, 0.2)
    if pods is not None:
        checker.claim_check = pods.check
        checker.plugin_clients = 2  # gpuplex-dra's DRA driver and device plugin
    clock = ClockStep(run, svc)
    extra["clock-step"] = clock.inject
    faults = node.Faults(run, svc, os.path.join(a.work, "state"), schedule, rng_fault, extra)
    run.truncated = faults.truncated

    stop = threading.Event()
    def on_signal(signum, _frame):
        if stop.is_set():
            raise KeyboardInterrupt
        run.log(f"{signal.Signals(signum).name}: ending the run early (again to abandon it)")
        stop.set()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # A thread of the run that dies (the checker, a generator) would leave the run checking
    # nothing and passing: its death is a violation, and the traceback is printed as usual.
    default_hook = threading.excepthook

    def on_thread_death(args):
        default_hook(args)
        name = args.thread.name if args.thread else "?"
        run.violation("harness", f"thread {name} died: {args.exc_type.__name__}: {args.exc_value}")
    threading.excepthook = on_thread_death

    threads = {name: threading.Thread(target=f, name=name, daemon=True) for name, f in [
        ("service", svc.supervise), ("freezer", checker.sample_freezer), ("checker", checker.loop),
        ("workload", work.loop), ("faults", faults.loop)]}
    threads["service"].start()
    for _ in range(300):
        if svc.up or not threads["service"].is_alive():
            break
        time.sleep(0.1)
    if not svc.up:
        run.log(f"the node service did not start: {svc.tail(5)}")
        svc.stop()
        return 2
    for part, _ in parts:
        if not part.start():
            run.log(f"{part.name} did not start; see {a.out}")
            stop_parts(parts)
            svc.stop()
            return 2
    if pods is not None and not pods.start():
        run.log(f"the kubelet's plugins did not start; see {a.work}/kubelet")
        pods.stop()
        stop_parts(parts)
        svc.stop()
        return 2
    for name in ("freezer", "checker", "workload", "faults"):
        threads[name].start()
    if pods is not None:
        threads["pods"] = start_thread(pods)
    stop.wait(seconds)
    run.log("the run is over: stopping the generator and the faults")
    faults.quit = work.quit = True
    if pods is not None:
        pods.quit = True
    threads["faults"].join(60)
    threads["workload"].join(180)
    if pods is not None:
        threads["pods"].join(180)
    svc.hold.clear()
    for _ in range(300):
        if svc.up and not svc.stopped:
            break
        time.sleep(0.1)
    time.sleep(checks.GONE_SETTLE + 1)
    checker.quit = True
    threads["checker"].join(10)
    threads["freezer"].join(10)
    end = final_checks(run, svc, work, checker, pods)
    if pods is not None:
        pods.stop()
    stop_parts(parts)
    svc.stop()
    run.log("service stopped (SIGTERM)")
    shim_log = os.path.join(a.work, "service.log")  # what services a shim started wrote
    if os.path.exists(shim_log):
        shutil.copy(shim_log, os.path.join(a.out, "service-shim-started.log"))
    compared = checker.check_resources()
    return summary(run, a, svc, work, faults, checker, end, compared, pods)


def make_pods(run, a, podman):
    """The kubelet's pods (pods.py), with podman's command line `podman`, unless SOAK_PODS is
    0-0."""
    lo, hi = (int(x) for x in a.pods.split("-"))
    if hi == 0:
        return None
    cpus = a.cpus if a.cpus != "none" else None
    return Pods(run, a.work, a.bin, podman, a.rootfs, cpus, a.seed, lo, hi, 4 * a.churn, a.run_id)


def make_parts(run, a):
    """The runtimes containers run through, each with its share of the new containers (the
    first takes what the others leave). One more part: one more line here."""
    cpus = a.cpus if a.cpus != "none" else None
    parts = [(Podman(run, a.podman_dir, a.rootfs, cpus), 1.0)]
    if a.containerd > 0:
        parts.append((Containerd(run, a.work, a.bin, a.rootfs, cpus), a.containerd))
    return parts


def shares(parts):
    rest = 1.0 - sum(share for _, share in parts[1:])
    return [(parts[0][0], rest)] + parts[1:]


def stop_parts(parts):
    for part, _ in reversed(parts):
        part.stop()


def final_checks(run, svc, work, checker, pods):
    """After the settle: the invariants once more, then every container removed and the node
    must hold nothing (no container, no reservation, all memory unreserved)."""
    end = {}
    try:
        reply, _ = node.request(svc.socket, '{"op":"status"}')
        st = reply["status"]
        checker.check_frozen(st)
        checker.check_vgpus(st, final=True)
        end["containers_before_drain"] = len(st["containers"])
        run.log(f"final check: {len(work.live())} live containers, {len(st['containers'])} vGPUs")
    except (OSError, ValueError, KeyError) as e:
        run.violation("socket-error", f"final status: {e}")
        return end
    if pods is not None:
        pods.drain()
        run.log("every kubelet pod removed, every allocation released")
    work.remove_all()
    run.log("every container removed; settling")
    time.sleep(checks.GONE_SETTLE)
    # A reservation a fault orphaned lapses reservation_ttl after it was made: waited for.
    deadline = time.monotonic() + checks.RESERVATION_TTL + 5
    while True:
        try:
            reply, _ = node.request(svc.socket, '{"op":"status"}')
            st = reply["status"]
        except (OSError, ValueError) as e:
            run.violation("socket-error", f"status after the drain: {e}")
            return end
        near = run.fault_near(run.now() - checks.RESERVATION_TTL - 5, run.now())
        if not (st["reservations"] and near and time.monotonic() < deadline):
            break
        if st["reservations"]:
            run.log(f"waiting for {len(st['reservations'])} reservation(s) a fault orphaned to lapse")
        time.sleep(5)
    run.count_check("empty-at-end")
    held = [f"GPU {g['index']}: {g['capacity'] - g['unreserved']} bytes" for g in st["gpus"]
            if g["unreserved"] != g["capacity"]]
    if st["containers"] or st["reservations"] or held:
        run.violation("leak-at-end", f"with every container removed the node still holds "
                      f"{len(st['containers'])} vGPU(s) {[c['vgpu'] for c in st['containers']]}, "
                      f"{len(st['reservations'])} reservation(s), memory: {held}")
    end["after_drain"] = svc.sample(0)
    return end


def resource_ends(svc):
    """The service's (containers, fds, threads, RSS KiB) at the start (first sample after the
    warm-up of the first lifetime) and at the end (last sample of the last lifetime)."""
    lives = [l for l in svc.lifetimes if l["samples"]]
    if not lives:
        return None, None
    first = next((x for x in lives[0]["samples"] if x[0] >= checks.WARMUP), lives[0]["samples"][-1])
    return first[1:], lives[-1]["samples"][-1][1:]


def summary(run, a, svc, work, faults, checker, end, compared, pods):
    by_kind = {}
    for v in run.violations:
        by_kind[v["kind"]] = by_kind.get(v["kind"], 0) + 1
    start, last = resource_ends(svc)
    lat = checker.latency_summary()
    fmt = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"  # noqa: E731
    res = (lambda r: f"{r[1]} fds, {r[2]} threads, {r[3] / 1024:.1f} MiB RSS, {r[4]} connections "
           f"with {r[0]} containers and {r[5]} shims" if r else "-")  # noqa: E731
    rows = [
        ("seed", a.seed), ("minutes", f"{run.now() / 60:.1f} (asked {a.minutes:g})"),
        ("containers", f"{a.min}-{a.max} kept alive; {work.attempts} starts tried, {work.started} "
                       f"started ({fmt(work.by_part)}), {work.removed} removed, {work.exited} "
                       "exited by themselves"),
        ("refusals", fmt(work.refusals)),
        ("faults", fmt({k: v for k, v in faults.done.items() if v})),
        ("service restarts", f"{svc.restarts} ({svc.failed_starts} failed starts, {svc.adopted} "
                             "services a shim started adopted)"),
        *[row for part, _ in work.parts for row in part.summary()],
        *(pods.summary() if pods is not None else []),
        ("invariant checks", fmt(run.checks)),
        ("violations", fmt(by_kind)),
        ("service at start", res(start)), ("service at end", res(last)),
        ("lifetimes compared (fds/threads/RSS)", len(compared)),
        ("socket latency", f"p50 {lat.get('p50_ms', '-')} ms, p99 {lat.get('p99_ms', '-')} ms, "
                           f"max {lat.get('max_ms', '-')} ms over {lat['n']} requests"
                           f" ({checker.slow_under_load} over 100 ms under load >= 2 not counted)"),
        ("longest freeze seen", "; ".join(f"{p}: {s:.1f}s {who}" for p, (s, who)
                                          in sorted(checker.longest_freeze.items())) or "none"),
    ]
    print()
    print("| make soak | |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    report = {
        "seed": a.seed, "minutes_asked": a.minutes, "seconds": round(run.now(), 1),
        "replay": a.replay, "containers_min": a.min, "containers_max": a.max, "cpus": a.cpus,
        "fault_every_s": a.fault_every, "containerd_share": a.containerd,
        "start_attempts": work.attempts, "started": work.started, "started_by_part": work.by_part,
        "removed": work.removed, "exited": work.exited, "refusals": work.refusals,
        "faults": faults.done, "truncated": faults.truncated, "restarts": svc.restarts,
        "failed_starts": svc.failed_starts, "adopted": svc.adopted,
        "parts": {part.name: dict(part.summary()) for part, _ in work.parts}, "checks": run.checks, "violations_by_kind": by_kind,
        "violations": run.violations, "service_start": start, "service_end": last,
        "lifetimes_compared": compared, "latency": lat, "end": end,
        "longest_freeze_s": {p: round(s, 1) for p, (s, _w) in checker.longest_freeze.items()},
        "sample_fields": ["t", "containers", "fds", "threads", "rss_kb", "connections", "shims",
                          "pidfds", "cgroup_files", "other_fds", "container_processes", "proc_files"],
        "lifetimes": svc.lifetimes,
    }
    path = os.path.join(a.out, "soak.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(f"report: {path} (with soak.log and service.log beside it)")
    if run.violations:
        print(f"make soak: {len(run.violations)} violation(s); replay with: {a.replay}")
        return 1
    print("make soak: no violation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
