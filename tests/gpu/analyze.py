#!/usr/bin/env python3
"""Measurements for tests/gpu/verify.sh.

  analyze.py wait --ctl BIN --socket S --id ID --state STATE [--touch F | --remove F] [--timeout T]
      Creates or removes the gate file F, then polls `gpuplexctl status -o json` until container ID
      is in STATE; prints the seconds that took ("timeout" and exit 1 if it did not happen).
  analyze.py report DIR
      Reads what verify.sh left in DIR (logs, traces, phases, status snapshots), prints the
      summary table and exits 0 when every check passed, 1 otherwise.

Only the standard library is used, so that the report also runs where torch is not installed.
"""

import json
import os
import subprocess
import sys
import time


# ---------------------------------------------------------------------------------------------
# Reading what the loops wrote


def read_rows(path):
    """The rows of a log or trace file as tuples of floats (torn last lines are skipped)."""
    rows = []
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                parts = line.split()
                try:
                    rows.append(tuple(float(x) for x in parts))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return rows


def count_at(rows, t):
    """Matmuls done by time t: the total of the last row at or before t (rows: time, total, ...)."""
    total = 0.0
    for row in rows:
        if row[0] > t:
            break
        total = row[1]
    return total


def interpolated(rows, t):
    """The total at time t, linear between the log lines around it."""
    prev = None
    for row in rows:
        if row[0] >= t:
            if prev is None or row[0] == prev[0]:
                return row[1]
            share = (t - prev[0]) / (row[0] - prev[0])
            return prev[1] + share * (row[1] - prev[1])
        prev = row
    return prev[1] if prev else 0.0


def rate(log_rows, t0, t1):
    """Matmuls per second between t0 and t1 from a periodic log."""
    if t1 <= t0:
        return None
    return (interpolated(log_rows, t1) - interpolated(log_rows, t0)) / (t1 - t0)


def percentile(values, q):
    """Nearest-rank percentile, q in 0..100; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, int(-(-q * len(ordered) // 100)))
    return ordered[min(rank, len(ordered)) - 1]


def switches(traces, t0, t1, min_run=3):
    """Window changes seen in the traces between t0 and t1.

    traces: {loop id: [(completion time, total, queued time), ...]}. The completions of all loops
    are merged in time order; a switch is where a run of at least `min_run` completions of one
    loop is followed by a run of at least `min_run` of another (shorter runs are the overlap of
    a hand-over and are skipped). For each switch from A to B it gives:
      handover: B's first completion - A's last completion (what the loops see: one stopped,
        the other resumed; B's first completion is often a batch queued before B was frozen,
        which the GPU finished meanwhile and B only notices once thawed);
      resume: completion of B's first batch queued after A's last completion - A's last
        completion (includes one batch of B's own GPU work, and whatever A still had queued on
        the GPU when it was frozen).
    """
    events = sorted(
        (row[0], loop, row[2] if len(row) > 2 else row[0])
        for loop, rows in traces.items()
        for row in rows
        if t0 <= row[0] <= t1
    )
    runs = []  # [loop, [events]]
    for event in events:
        if runs and runs[-1][0] == event[1]:
            runs[-1][1].append(event)
        else:
            runs.append([event[1], [event]])
    runs = [run for run in runs if len(run[1]) >= min_run]
    merged = []
    for run in runs:  # dropping short runs can leave two runs of one loop side by side
        if merged and merged[-1][0] == run[0]:
            merged[-1][1].extend(run[1])
        else:
            merged.append(run)
    handovers, resumes = [], []
    for (_, before), (_, after) in zip(merged, merged[1:]):
        last = before[-1][0]
        handovers.append(after[0][0] - last)
        fresh = next((e[0] for e in after if e[2] > last), None)
        if fresh is not None:
            resumes.append(fresh - last)
    return handovers, resumes


def overlap(directory, t0, t1):
    """From record.py's logs, between t0 and t1: the seconds during which two or more loop
    cgroups were not frozen at once, and how many times the service turned a running container
    idle (every loop has work during the shares, so each is a lapse). None without the logs."""
    cgroups, states = os.path.join(directory, "cgroups.log"), os.path.join(directory, "states.log")
    if not (os.path.exists(cgroups) and os.path.exists(states)):
        return None
    polls = {}  # time -> {cgroup: frozen}
    with open(cgroups) as f:
        for line in f:
            t, name, state = line.split()
            if t0 <= float(t) <= t1:
                polls.setdefault(float(t), {})[name] = state
    times = sorted(polls)
    names = set(n for p in polls.values() for n in p)
    apart = sum(b - a for a, b in zip(times, times[1:])
                if len(polls[a]) == len(names) and list(polls[a].values()).count("0") >= 2)
    lapses, before = 0, {}
    with open(states) as f:
        for line in f:
            t, _, containers = json.loads(line)
            now = {c[0]: c[1] for c in containers}
            if t0 <= t <= t1:
                lapses += sum(1 for c, state in now.items() if state == "idle" and before.get(c) == "running")
            before = now
    return apart, lapses


def batch_time(trace_rows, t0, t1):
    """Median time between two completions of one loop running alone between t0 and t1."""
    times = [row[0] for row in trace_rows if t0 <= row[0] <= t1]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return percentile(gaps, 50)


# ---------------------------------------------------------------------------------------------
# wait


def status(ctl, socket):
    out = subprocess.run(
        [ctl, "--socket", socket, "status", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)


def container_state(doc, container):
    for c in (doc or {}).get("containers", []):
        if c.get("id") == container:
            return c.get("state")
    return None


def wait(args):
    opts = dict(zip(args[::2], args[1::2]))
    ctl, socket = opts["--ctl"], opts["--socket"]
    container, want = opts["--id"], opts["--state"]
    timeout = float(opts.get("--timeout", "10"))
    start = time.time()
    if "--touch" in opts:
        open(opts["--touch"], "a", encoding="ascii").close()
    if "--remove" in opts:
        os.remove(opts["--remove"])
    while time.time() - start < timeout:
        if container_state(status(ctl, socket), container) == want:
            print("%.3f" % (time.time() - start))
            return 0
        time.sleep(0.01)
    print("timeout")
    return 1


# ---------------------------------------------------------------------------------------------
# report


def read_pairs(path):
    """Lines `key value...` as a list of (key, [values])."""
    pairs = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if parts:
                    pairs.append((parts[0], parts[1:]))
    except FileNotFoundError:
        pass
    return pairs


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def fmt(value, spec="%.3f", unit=""):
    return "n/a" if value is None else (spec % value) + unit


def report(directory):
    d = lambda name: os.path.join(directory, name)  # noqa: E731
    meta = dict((k, " ".join(v)) for k, v in read_pairs(d("meta")))
    phases = dict((k, (float(v[0]), float(v[1]))) for k, v in read_pairs(d("phases")) if len(v) == 2)
    weights = dict((k, int(v[0])) for k, v in read_pairs(d("weights")))
    loops = sorted(weights)
    logs = {loop: read_rows(d(loop + ".log")) for loop in loops}
    traces = {loop: read_rows(d(loop + ".trace")) for loop in loops}
    share_tol = float(os.environ.get("GPUPLEX_VERIFY_SHARE_TOL", "0.10"))
    min_ratio = float(os.environ.get("GPUPLEX_VERIFY_MIN_RATIO", "0.95"))
    rows, failures = [], []

    def row(what, value, limit="", verdict=""):
        rows.append((what, value, limit, verdict))
        if verdict == "FAIL":
            failures.append(what)

    def check(ok):
        return "PASS" if ok else "FAIL"

    first = loops[0] if loops else None
    # 1. Throughput alone, unregistered and registered.
    alone = {}
    for phase in ("alone_unregistered", "alone_registered"):
        if first and phase in phases:
            alone[phase] = rate(logs[first], *phases[phase])
    r0, r1 = alone.get("alone_unregistered"), alone.get("alone_registered")
    row("alone, not registered: matmul/s", fmt(r0, "%.1f"))
    row("alone, registered: matmul/s", fmt(r1, "%.1f"))
    ratio = r1 / r0 if r0 and r1 is not None else None
    row("  registered / not registered", fmt(ratio), ">= %.2f" % min_ratio,
        check(ratio is not None and ratio >= min_ratio))
    if first and "alone_unregistered" in phases:
        bt = batch_time(traces[first], *phases["alone_unregistered"])
        row("  batch time alone (median)", fmt(bt and bt * 1000, "%.2f", " ms"))

    # 2. Activity detection.
    for kind, label in (("start", "work starts -> state running"), ("idle", "work stops -> state idle")):
        values = [v[1] for k, v in read_pairs(d("detect")) if k == kind and len(v) == 2]
        timeouts = [v for v in values if v == "timeout"]
        seconds = [float(v) for v in values if v != "timeout"]
        shown = "n/a" if not seconds else "%s / %s s (n=%d)" % (
            fmt(percentile(seconds, 50)), fmt(max(seconds)), len(seconds))
        row(label + " (median / max)", shown, "within timeout",
            check(bool(values) and not timeouts))

    # 3. Shares.
    if "shares" in phases:
        t0, t1 = phases["shares"]
        done = {loop: count_at(traces[loop], t1) - count_at(traces[loop], t0) for loop in loops}
        total = sum(done.values())
        weight_sum = sum(weights.values())
        before, after = read_json(d("status-shares-begin.json")), read_json(d("status-shares-end.json"))
        gpu_s = {}
        for loop in loops:
            b = next((c for c in (before or {}).get("containers", []) if c.get("id") == loop), None)
            a = next((c for c in (after or {}).get("containers", []) if c.get("id") == loop), None)
            if a and b:
                gpu_s[loop] = a["gpu_seconds"] - b["gpu_seconds"]
        gpu_total = sum(gpu_s.values())
        row("shares over %.0f s (matmuls; gpuplex's gpu_seconds)" % (t1 - t0), "", "weight share +- %.2f" % share_tol)
        for loop in loops:
            target = weights[loop] / weight_sum
            share = done[loop] / total if total else None
            accounted = gpu_s[loop] / gpu_total if gpu_total else None
            row("  %s (weight %d): %d matmuls" % (loop, weights[loop], done[loop]),
                "%s (%s)" % (fmt(share), fmt(accounted)), "%.3f" % target,
                check(share is not None and abs(share - target) <= share_tol))
        if before and after and before.get("gpus") and after.get("gpus"):
            n = after["gpus"][0]["switches"] - before["gpus"][0]["switches"]
            row("  window switches (gpuplex)", str(n), "> 0", check(n > 0))
        handovers, resumes = switches(traces, t0, t1)
        ms = lambda v: v and v * 1000  # noqa: E731
        row("  switches seen in the traces", str(len(handovers)))
        row("  hand-over A last -> B first (p50 / p99)",
            "%s / %s" % (fmt(ms(percentile(handovers, 50)), "%.1f"), fmt(ms(percentile(handovers, 99)), "%.1f", " ms")))
        row("  resume A last -> B fresh batch (p50 / p99)",
            "%s / %s" % (fmt(ms(percentile(resumes, 50)), "%.1f"), fmt(ms(percentile(resumes, 99)), "%.1f", " ms")))
        recorded = overlap(d("record"), t0, t1)
        if recorded:
            row("  two or more loops not frozen at once", "%.2f s of %.0f" % (recorded[0], t1 - t0))
            row("  a loop with work turned idle", "%d times" % recorded[1])

    # 4. Fail open.
    states = read_pairs(d("failopen"))
    if states:
        frozen = [k for k, v in states if v and v[0] not in ("THAWED", "0")]
        row("thawed after the service's SIGTERM", "all" if not frozen else "frozen: " + ",".join(frozen),
            "all", check(not frozen))
    for k, v in read_pairs(d("checks")):
        row(k.replace("_", " "), " ".join(v[1:]), "", v[0] if v else "FAIL")

    print()
    print("gpuplex GPU check: %s" % ", ".join("%s %s" % kv for kv in sorted(meta.items())))
    width = max(len(r[0]) for r in rows) if rows else 10
    valw = max(len(r[1]) for r in rows) if rows else 10
    for what, value, limit, verdict in rows:
        print("%-*s  %-*s  %-24s %s" % (width, what, valw, value, limit, verdict))
    print()
    if failures:
        print("FAIL: %d check(s) failed: %s" % (len(failures), "; ".join(f.strip() for f in failures)))
        return 1
    print("PASS: every check held (see tests/gpu/README.md for what each number means)")
    return 0


def main(argv):
    if len(argv) >= 1 and argv[0] == "wait":
        return wait(argv[1:])
    if len(argv) == 2 and argv[0] == "report":
        return report(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
