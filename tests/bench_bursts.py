"""make bench-bursts' analyzer (tests/bench_bursts.sh runs it; standard library only).

  bench_bursts.py offset            prints epoch ms minus /proc/uptime ms (uptime cs -> epoch ms)
  bench_bursts.py analyze RUNDIR    one run: reads RUNDIR/{run,window,containers,events.json} and
                                    the burst logs, writes RUNDIR/result.json, prints a table row
  bench_bursts.py table OUT RESULT...  the markdown table of those results; writes them to OUT

A run's window holders come from the node service's events (`gpuplexctl timeline -o json`): each
change of the GPU's holder. Who wants the GPU at an instant: the steady containers always, a
bursty one from a burst's intended start to its end (its log, in uptime centiseconds).
"""
import bisect
import json
import math
import os
import sys
import time

FROZEN_CS = 3  # a wake more than 30 ms after the intended start: the burst began frozen


def fail(why):
    sys.exit(f"bench_bursts: {why}")


def offset():
    """Epoch ms minus uptime ms, taken at an edge of /proc/uptime's centisecond so it is exact
    to a millisecond or so (both clocks read together, as the brief of the benchmark asks)."""
    def uptime():
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])

    first = uptime()
    deadline = time.time() + 0.2
    while time.time() < deadline:
        now = uptime()
        at = time.time()
        if now != first:
            return round(at * 1000 - now * 1000)
    return round(time.time() * 1000 - uptime() * 1000 - 5)  # no edge seen: mid-centisecond


def read_words(path, count, what):
    with open(path) as f:
        words = f.read().split()
    if len(words) != count:
        fail(f"{path}: expected {count} words ({what}), found {len(words)}")
    return words


def read_bursts(logdir, off):
    """A bursty container's bursts, [(intended start, end, begun frozen)] in epoch ms, oldest
    first: `bursts` has a line per finished burst (intended wake end amount, uptime cs);
    `current` the last one begun or pending (intended amount [wake]), which may not have ended
    when the containers were removed: it wants the GPU until the end (end = inf). One that never
    woke although its time had come was frozen (the analyzed bursts began 3 s before removal)."""
    rows = []
    if os.path.exists(f"{logdir}/bursts"):
        with open(f"{logdir}/bursts") as f:
            for line in f:
                cs = [int(x) for x in line.split()]
                if len(cs) != 4:
                    fail(f"{logdir}/bursts: not `intended wake end amount`: {line!r}")
                rows.append((cs[0] * 10 + off, cs[2] * 10 + off, cs[1] - cs[0] > FROZEN_CS))
    if os.path.exists(f"{logdir}/current"):
        with open(f"{logdir}/current") as f:
            cs = [int(x) for x in f.read().split()]
        if len(cs) not in (2, 3):
            fail(f"{logdir}/current: not `intended amount [wake]`: {cs}")
        if not rows or cs[0] * 10 + off > rows[-1][0]:
            rows.append((cs[0] * 10 + off, math.inf, len(cs) == 2 or cs[2] - cs[0] > FROZEN_CS))
    return rows


def percentile(values, p):
    """Nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def holders(events, ids, start, end):
    """[(from_ms, to_ms, name or None)] over [start, end] and the list of (at_ms, name) of every
    event (for the burst waits). A holder that is none of ours is named '?'."""
    if not isinstance(events.get("events"), list) or not isinstance(events.get("first"), int):
        fail("events.json: not gpuplexctl timeline -o json output ({first, events})")
    evs = sorted(events["events"], key=lambda e: (e["at_ms"], e["seq"]))
    if events["first"] > 1 and (not evs or evs[0]["at_ms"] > start):
        fail(f"the node service kept events from #{events['first']} only: the holder at the "
             "window's start is lost (more than 4096 window changes?)")
    named = []
    for e in evs:
        c = e.get("container")
        if e.get("vgpu") is None:
            name = None
        else:
            matches = [n for i, n in ids.items() if c and (i == c or i.startswith(c))]
            name = matches[0] if len(matches) == 1 else "?"
        named.append((e["at_ms"], name))
    spans, holder, at = [], None, start
    for t, name in named:
        if t <= start:
            holder = name
            continue
        if t >= end:
            break
        spans.append((at, t, holder))
        holder, at = name, t
    spans.append((at, end, holder))
    return [s for s in spans if s[1] > s[0]], named


def analyze(rundir):
    core, load, case = read_words(f"{rundir}/run", 3, "core load case")
    start, end, off = (int(w) for w in read_words(f"{rundir}/window", 3, "start end offset"))
    if end - start < 1000:
        fail(f"{rundir}/window: a window of {end - start} ms")
    containers = []  # (name, role, weight, id)
    with open(f"{rundir}/containers") as f:
        for line in f:
            name, role, weight, cid = line.split()
            containers.append((name, role, int(weight), cid))
    ids = {cid: name for name, _, _, cid in containers}
    weight = {name: w for name, _, w, _ in containers}
    with open(f"{rundir}/events.json") as f:
        spans, named = holders(json.load(f), ids, start, end)
    ours = {n for _, n in named if n not in (None, "?")}
    if not ours:
        fail(f"{rundir}: no window event names one of the containers (the `container` field "
             f"holds neither the podman ids nor their prefixes: {named[:3]})")

    # Each bursty container's bursts: (intended start, wake, end, amount) in epoch ms.
    bursts = {n: read_bursts(f"{rundir}/log-{n}", off)
              for n, role, _, _ in containers if role == "bursty"}
    starts = {n: [b[0] for b in rows] for n, rows in bursts.items()}

    def wants(name, t):
        if name not in bursts:
            return True  # steady
        i = bisect.bisect_right(starts[name], t) - 1
        return i >= 0 and bursts[name][i][0] <= t < bursts[name][i][1]

    # Sweep the window in pieces where neither the holder nor who wants changes.
    cuts = {start, end} | {a for a, _, _ in spans}
    for rows in bursts.values():
        cuts |= {t for b in rows for t in b[:2] if start < t < end}
    cuts = sorted(cuts)
    held = {n: 0.0 for n in weight}
    fair = {n: 0.0 for n in weight}
    busy = idle = other = 0.0
    si = 0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        while spans[si][1] <= mid:
            si += 1
        holder = spans[si][2]
        wanting = [n for n in weight if wants(n, mid)]
        total = sum(weight[n] for n in wanting)
        for n in wanting:
            fair[n] += (b - a) * weight[n] / total
        if holder in wanting:
            busy += b - a
            held[holder] += b - a
        elif holder == "?":
            other += b - a
        elif holder is not None:
            idle += b - a  # one of ours holds it without work (a bursty one between bursts)
    length = end - start

    # Burst waits: intended start to its first window (0 if it held the window then).
    waits, waits_running, frozen, warmup, outside, no_window = [], [], 0, 0, 0, 0
    times = [t for t, _ in named]
    for name, rows in bursts.items():
        for s, _, began_frozen in rows:
            if s < start:
                warmup += 1
                continue
            if s >= end:
                outside += 1
                continue
            i = bisect.bisect_right(times, s) - 1
            if i >= 0 and named[i][1] == name:
                wait = 0
            else:
                later = [t for t, n in named[i + 1:] if n == name]
                if not later:
                    no_window += 1
                    continue
                wait = later[0] - s
            waits.append(wait)
            frozen += began_frozen
            if not began_frozen:
                waits_running.append(wait)

    steady = sorted((n for n, r, _, _ in containers if r == "steady"), key=weight.get)
    bursty = [n for n, r, _, _ in containers if r == "bursty"]
    pct = lambda ms: round(100 * ms / length, 2)  # noqa: E731
    result = {
        "core": core, "load": load, "case": case, "window_ms": length,
        "busy_while_wanted": pct(busy), "held_without_work": pct(idle),
        "held_by_others": pct(other),
        "window_changes": sum(1 for t, _ in named if start <= t < end),
        "steady": [{"name": n, "weight": weight[n], "share": pct(held[n]), "fair": pct(fair[n])}
                   for n in steady],
        "bursty": [{"name": n, "share": pct(held[n]), "fair": pct(fair[n]),
                    "bursts": len(bursts[n])} for n in bursty],
        "bursty_share": pct(sum(held[n] for n in bursty)),
        "bursty_fair": pct(sum(fair[n] for n in bursty)),
        "bursts": {"used": len(waits), "begun_frozen": frozen,
                   "left_out_warmup": warmup, "left_out_no_window": no_window,
                   "after_window": outside,
                   "wait_ms_p50": percentile(waits, 50), "wait_ms_p99": percentile(waits, 99),
                   "wait_ms_p50_running": percentile(waits_running, 50),
                   "wait_ms_p99_running": percentile(waits_running, 99),
                   "wait_ms": waits} if bursty else None,
    }
    with open(f"{rundir}/result.json", "w") as f:
        json.dump(result, f, indent=1)
    print(row(result))


HEADER = ("| load | case | core | busy while wanted (held without work) | steady w=1 · w=2 · w=3: share (fair) "
          "| bursty: share (fair) | burst wait p50 / p99 | begun running: p50 / p99 "
          "| begun frozen | bursts used (left out) |\n" + "|---" * 10 + "|")


def row(r):
    steady = " · ".join(f"{s['share']:.1f} ({s['fair']:.1f})" for s in r["steady"])
    b = r["bursts"]
    if b is None:
        rest = "| – | – | – | – | – |"
    else:
        ms = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
        rest = (f"| {r['bursty_share']:.1f} ({r['bursty_fair']:.1f}) "
                f"| {ms(b['wait_ms_p50'])} / {ms(b['wait_ms_p99'])} ms "
                f"| {ms(b['wait_ms_p50_running'])} / {ms(b['wait_ms_p99_running'])} ms "
                f"| {b['begun_frozen']} of {b['used']} | {b['used']} ({b['left_out_warmup']} "
                f"warm-up, {b['left_out_no_window']} no window) |")
    return (f"| {r['load']} | {r['case']} | {r['core']} | {r['busy_while_wanted']:.1f}% "
            f"(held idle {r['held_without_work']:.1f}%) "
            f"| {steady} {rest}")


def table(out, paths):
    results = []
    for p in paths:
        with open(p) as f:
            results.append(json.load(f))
    print(HEADER)
    for r in results:
        print(row(r))
    with open(out, "w") as f:
        json.dump({"results": results, "env": {k: v for k, v in os.environ.items()
                                               if k.startswith("GPUPLEX_")}}, f, indent=1)


def main(argv):
    try:
        if argv[1:] == ["offset"]:
            print(offset())
        elif len(argv) == 3 and argv[1] == "analyze":
            analyze(argv[2])
        elif len(argv) >= 4 and argv[1] == "table":
            table(argv[2], argv[3:])
        else:
            fail("usage: bench_bursts.py offset | analyze RUNDIR | table OUT RESULT...")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        fail(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main(sys.argv)
