#!/usr/bin/env python3
"""Records, beside verify.sh's loops, what explains a hand-over that was not clean.

Until the stop file appears, it appends to the output directory:
  cgroups.log  every 10 ms: <time> <cgroup name> <1 frozen | 0 not>, for each loop cgroup
               (v2: `frozen` in cgroup.events; v1: freezer.state FROZEN)
  states.log   every ~25 ms: [time, [holder of each GPU], [[container, state, lag], ...]]
               from `gpuplexctl status -o json`
  nvml.log     every 20 ms, each per-process sample NVML has not shown before (the whole buffer
               is read, lastSeenTimeStamp = 0): <time first seen> <pid> <sample timestamp us>
               <sm> <mem>; absent when libnvidia-ml.so.1 cannot be loaded
  pids.log     every 0.5 s: <time> <cgroup name> <its pids, comma-separated>

Usage: record.py --ctl PATH --socket PATH --out DIR --stop FILE CGROUP...
"""

import argparse
import ctypes
import json
import os
import subprocess
import time


class Sample(ctypes.Structure):  # nvmlProcessUtilizationSample_t
    _fields_ = [("pid", ctypes.c_uint), ("timestamp", ctypes.c_ulonglong), ("sm", ctypes.c_uint),
                ("mem", ctypes.c_uint), ("enc", ctypes.c_uint), ("dec", ctypes.c_uint)]


class Nvml:
    """NVML's GPU 0 through ctypes, or nothing."""

    def __init__(self):
        self.lib = self.device = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        device = ctypes.c_void_p()
        if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) == 0:
            self.lib, self.device = lib, device
        self.buffer = (Sample * 512)()
        self.seen = set()

    def new_samples(self):
        if self.lib is None:
            return []
        count = ctypes.c_uint(len(self.buffer))
        rc = self.lib.nvmlDeviceGetProcessUtilization(
            self.device, self.buffer, ctypes.byref(count), ctypes.c_ulonglong(0))
        if rc != 0:  # NOT_FOUND (no samples) among others
            return []
        fresh = []
        for s in self.buffer[: count.value]:
            if (s.pid, s.timestamp) not in self.seen:
                self.seen.add((s.pid, s.timestamp))
                fresh.append((s.pid, s.timestamp, s.sm, s.mem))
        return fresh


def frozen(cgroup):
    try:
        with open(os.path.join(cgroup, "cgroup.events")) as f:
            return next(line.split()[1] for line in f if line.startswith("frozen "))
    except FileNotFoundError:
        with open(os.path.join(cgroup, "freezer.state")) as f:
            return "1" if f.read().strip() == "FROZEN" else "0"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ctl", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("cgroups", nargs="+")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logs = {n: open(os.path.join(args.out, n + ".log"), "w") for n in ("cgroups", "states", "pids")}
    nvml = Nvml()
    nvml_log = open(os.path.join(args.out, "nvml.log"), "w") if nvml.lib else None
    last_status = last_pids = 0.0
    while not os.path.exists(args.stop):
        now = time.time()
        for cg in args.cgroups:
            try:
                logs["cgroups"].write("%.4f %s %s\n" % (now, os.path.basename(cg), frozen(cg)))
            except (OSError, StopIteration):
                pass
        if nvml_log:
            for pid, ts, sm, mem in nvml.new_samples():
                nvml_log.write("%.4f %d %d %d %d\n" % (now, pid, ts, sm, mem))
        if now - last_status >= 0.025:
            last_status = now
            r = subprocess.run([args.ctl, "--socket", args.socket, "status", "-o", "json"],
                               capture_output=True, text=True, check=False)
            if r.returncode == 0:
                doc = json.loads(r.stdout)
                holders = [g["holder"] for g in doc["gpus"]]
                states = [[c["id"], c["state"], round(c.get("lag_seconds", 0.0), 3)]
                          for c in doc["containers"]]
                logs["states"].write(json.dumps([round(now, 4), holders, states]) + "\n")
        if now - last_pids >= 0.5:
            last_pids = now
            for cg in args.cgroups:
                try:
                    with open(os.path.join(cg, "cgroup.procs")) as f:
                        pids = ",".join(f.read().split())
                    logs["pids"].write("%.3f %s %s\n" % (now, os.path.basename(cg), pids))
                except OSError:
                    pass
        time.sleep(0.01)
    for f in list(logs.values()) + [nvml_log]:
        if f:
            f.close()


if __name__ == "__main__":
    main()
