"""make soak: containerd with gpuplex's shim as a part of the run (see podman.py for what a
part is), and its faults.

containerd runs from the run's directory (root, state and sockets under WORK/containerd), with
the shim on its PATH and $GPUPLEX_CONFIG naming the soak's gpuplex.toml, where the shim finds
the node socket (as tests/src/containerd.rs starts it). It is restarted RESTART_DELAY seconds
after it dies, as systemd's Restart=always would. Containers: `ctr run -d --rootfs` of the
busybox rootfs under io.containerd.gpuplex.v1, in a containerd namespace of the run's own, with
their gpuplex.io/ annotations as `--annotation` (as the tests give them), runc's state under
WORK/containerd/runc (a runtime options file), no stdio.

Faults:
- containerd-restart: kill -9 of containerd, restarted by the supervisor; every task that ran
  must run on with the same init and shim, and be listed RUNNING again.
- shim-kill9: kill -9 of one live container's shim; within KILL_SETTLE containerd must have
  cleaned up (no task left running, the init and the shim gone, nothing left frozen or in its
  cgroup). The container is gone: its vGPU must go as any gone container's (checks.py).
"""
import os
import signal
import subprocess
import threading
import time

from node import alive, cmdline, describe
from podman import last_line

RUNTIME = "io.containerd.gpuplex.v1"
SHIM = "containerd-shim-gpuplex-v1"
RESTART_DELAY = 2.0  # seconds from containerd's death to its restart (containerd.service: 5)
KILL_SETTLE = 10.0  # seconds containerd has to clean up after a shim's kill -9
# A shim containerd started but never asked for its container (it was killed in between) ends
# by itself a minute after its start (shim/src/task/daemon.rs); give it that and some more.
NEVER_ASKED_END = 75.0
KINDS = ["containerd-restart", "shim-kill9"]


class Containerd:
    name = "containerd"

    def __init__(self, run, work, bin_dir, rootfs, cpus):
        self.run, self.rootfs, self.cpus = run, rootfs, cpus
        self.dir = os.path.join(work, "containerd")
        self.socket = os.path.join(self.dir, "containerd.sock")
        self.namespace = f"gpuplex-soak-{os.getpid()}"
        self.options = os.path.join(self.dir, "runc-options.toml")
        self.env = dict(os.environ, PATH=f"{self.dir}/bin:{os.environ.get('PATH', '')}",
                        GPUPLEX_CONFIG=os.path.join(work, "gpuplex.toml"))
        self.bin_dir = bin_dir
        self.proc = None
        self.up = False
        self.quit = False
        self.killing = False  # a fault kills it: its death is no violation
        self.restarts = 0
        self.killed = []  # (container, monotonic time, shim pid): shim-kill9 not yet judged
        self.failed_runs = {}  # container id: monotonic time its `ctr run` failed
        self.kills = {"shims killed": 0, "cleaned up": 0, "slowest cleanup s": 0.0}
        self.fault_kinds = {"containerd-restart": self.fault_restart, "shim-kill9": self.fault_shim_kill}
        self.workload = None  # set by workload.Workload: its containers are the run's

    # --- the daemon ------------------------------------------------------------------------
    def start(self):
        """Writes the configuration, starts containerd and its supervisor; whether it answered."""
        os.makedirs(os.path.join(self.dir, "bin"), exist_ok=True)
        os.symlink(os.path.join(self.bin_dir, SHIM), os.path.join(self.dir, "bin", SHIM))
        d = self.dir
        disabled = ", ".join(f'"{p}"' for p in [
            "io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
            "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
            "io.containerd.snapshotter.v1.devmapper"])
        with open(os.path.join(d, "config.toml"), "w") as f:
            f.write(f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
                    f"disabled_plugins = [{disabled}]\n"
                    f'[grpc]\n  address = "{self.socket}"\n'
                    f'[ttrpc]\n  address = "{self.socket}.ttrpc"\n'
                    f'[debug]\n  address = "{d}/debug.sock"\n  level = "info"\n'
                    f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{d}/opt"\n')
        with open(self.options, "w") as f:
            f.write(f'Root = "{d}/runc"\n')
        self.run.write_file("containerd.namespace", self.namespace)
        self.spawn()
        if self.up:
            threading.Thread(target=self.supervise, name="containerd", daemon=True).start()
        return self.up

    def spawn(self):
        with open(os.path.join(self.run.out, "containerd.log"), "ab") as log:
            self.proc = subprocess.Popen(
                ["containerd", "--config", os.path.join(self.dir, "config.toml")], stdout=log,
                stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        self.run.write_file("containerd.pid", str(self.proc.pid))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            if os.path.exists(self.socket) and self.ctr("version", timeout=5).returncode == 0:
                self.up = True
                self.run.log(f"containerd up: pid {self.proc.pid}, namespace {self.namespace}")
                return
            time.sleep(0.05)
        self.run.log(f"containerd pid {self.proc.pid} did not answer within 10 s")

    def supervise(self):
        """The thread: wait for containerd's death, restart it; until quit."""
        while not self.quit:
            code = self.proc.wait()
            if self.quit:
                return
            died, self.up = time.monotonic(), False
            down = self.run.fault_begin("containerd-down")
            self.run.log(f"containerd pid {self.proc.pid} died ({describe(code)})")
            if not self.killing:
                self.run.violation("containerd-died", f"containerd (pid {self.proc.pid}) ended with no "
                                   f"fault injected: {describe(code)}")
            self.killing = False
            time.sleep(max(0.0, died + RESTART_DELAY - time.monotonic()))
            self.restarts += 1
            self.run.log(f"restarting containerd (restart {self.restarts}, as Restart=always)")
            self.spawn()
            self.run.fault_end("containerd-down", down)

    def wait_up(self, seconds=30.0):
        deadline = time.monotonic() + seconds
        while not self.up and time.monotonic() < deadline and not self.quit:
            time.sleep(0.1)
        return self.up

    def stop(self):
        """SIGTERM (the shims and their containers are the containers' to end), SIGKILL after 10 s."""
        self.quit = True
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.up = False

    # --- ctr -------------------------------------------------------------------------------
    def ctr(self, *args, timeout=60):
        try:
            return subprocess.run(["ctr", "--address", self.socket, "--namespace", self.namespace]
                                  + list(args), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, 124, "", f"ctr {args[0]} took over {timeout} s")

    def tasks(self):
        """{id: (pid, status)} as `ctr task ls` lists them, or None when containerd does not answer."""
        p = self.ctr("task", "ls", timeout=20)
        if p.returncode != 0:
            return None
        out = {}
        for line in p.stdout.splitlines()[1:]:
            f = line.split()
            if len(f) >= 3 and f[1].isdigit():
                out[f[0]] = (int(f[1]), f[2])
        return out

    def shims(self):
        """{container id: pid} of the shim daemons of this run's namespace."""
        out = {}
        for e in os.listdir("/proc"):
            if not e.isdigit():
                continue
            args = cmdline(e)
            if (not args or os.path.basename(args[0]) != SHIM or args[-1] in ("start", "delete")
                    or "-id" not in args or self.namespace not in args):
                continue
            i = args.index("-id")
            if i + 1 < len(args):
                out[args[i + 1]] = int(e)
        return out

    # --- the part: containers --------------------------------------------------------------
    def run_container(self, c):
        if not self.wait_up():
            return False, "containerd is not up"
        c.id = c.name
        self.run.append_file("containerd-ids.txt", c.id + "\n")
        args = ["run", "-d", "--null-io", "--rootfs", "--env", "PATH=/bin", "--runtime", RUNTIME,
                "--runtime-config-path", self.options]
        if self.cpus:
            args += ["--cpus", self.cpus]
        for k, v in c.annotations().items():
            args += ["--annotation", f"{k}={v}"]
        p = self.ctr(*args, self.rootfs, c.id, "sh", "-c", c.script, timeout=90)
        if p.returncode != 0:
            self.failed_runs[c.id] = time.monotonic()
            self.forget(c.id)
            return False, last_line(p.stderr)
        task = (self.tasks() or {}).get(c.id)
        c.pid = task[0] if task else None
        return True, ""

    def forget(self, cid):
        """Whatever a failed start left (a container, a created task) removed, once containerd
        answers."""
        self.wait_up()
        self.ctr("task", "rm", "-f", cid, timeout=30)
        self.ctr("container", "rm", cid, timeout=30)

    def remove(self, c, graceful):
        """SIGTERM and up to 2 s (graceful), then `ctr task rm -f` (SIGKILL) and `ctr container
        rm`; once more if containerd was down meanwhile."""
        why = ""
        for _attempt in range(2):
            if not self.wait_up():
                why = "containerd is not up"
                continue
            if graceful:
                self.ctr("task", "kill", "-s", "SIGTERM", c.id, timeout=20)
                for _ in range(20):
                    if not c.alive():
                        break
                    time.sleep(0.1)
            t = self.ctr("task", "rm", "-f", c.id, timeout=60)
            p = self.ctr("container", "rm", c.id, timeout=30)
            if p.returncode == 0:
                return True, ""
            why = last_line(p.stderr) + (f" (task rm: {last_line(t.stderr)})" if t.returncode else "")
        return False, why

    def remove_gone(self, c):
        self.forget(c.id)

    def remove_all(self):
        """Every container removed; then none may be listed and no shim of the run may be left."""
        problems = []
        if not self.wait_up():
            return ["containerd is not up at the end: its containers were not removed"]
        while self.killed and time.monotonic() - self.killed[0][1] < KILL_SETTLE:
            self.tick()
            time.sleep(0.5)
        self.tick(final=True)
        p = self.ctr("container", "ls", "-q", timeout=30)
        for cid in p.stdout.split():
            self.forget(cid)
        left = self.ctr("container", "ls", "-q", timeout=30).stdout.split()
        if left:
            problems.append(f"ctr container rm left {len(left)} container(s): {' '.join(left)}")
        deadline = time.monotonic() + 10
        while True:
            shims = self.shims()
            # Those of a failed `ctr run` may wait for containerd's Create up to a minute.
            unasked = [self.failed_runs[i] + NEVER_ASKED_END for i in shims if i in self.failed_runs]
            if not shims or time.monotonic() > max([deadline] + unasked):
                break
            time.sleep(0.1)
        if shims:
            said = {i: ("its ctr run failed" if i in self.failed_runs else "removed")
                    for i in shims}
            self.run.violation("shim-left", f"shims still run after their containers were "
                               f"removed (10 s; {NEVER_ASKED_END:.0f} s after a failed run): "
                               f"{shims} {said}")
        return problems

    # --- faults ----------------------------------------------------------------------------
    def live(self):
        return [c for c in list(self.workload.containers) if c.part is self and c.state == "live"]

    def fault_restart(self, _rng):
        before = {c: self.shims().get(c.id) for c in self.live()}
        pid = self.proc.pid
        self.run.log(f"FAULT containerd-restart: kill -9 of containerd (pid {pid}), {len(before)} "
                     "containers of it running")
        self.killing = True
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while self.up and time.monotonic() < t0 + 5:
            time.sleep(0.05)
        if not self.wait_up(60):
            self.run.violation("containerd-restart", "containerd did not come back within 60 s")
            return
        tasks = self.tasks() or {}
        kept = 0
        for c, shim in before.items():
            if c.state != "live" or not c.alive():
                continue  # removed or exited meanwhile
            task = tasks.get(c.id)
            if task != (c.pid, "RUNNING"):
                self.run.violation("containerd-restart", f"{c.describe()} runs (init pid {c.pid}) but "
                                   f"containerd lists its task as {task} after the restart")
            elif shim is not None and not alive(shim):
                self.run.violation("containerd-restart", f"{c.describe()}: its shim (pid {shim}) "
                                   "did not survive containerd's restart")
            else:
                kept += 1
        self.run.log(f"containerd back after {time.monotonic() - t0:.1f}s: {kept} of {len(before)} "
                     "containers listed RUNNING again with their shims")

    def fault_shim_kill(self, rng):
        live = sorted(self.live(), key=lambda c: c.seq)
        shims = self.shims()
        live = [c for c in live if c.id in shims]
        with_vgpu = [c for c in live if c.annotated and c.vgpu_last]
        if not live:
            self.run.log("FAULT shim-kill9: no live containerd container with a shim; skipped")
            return
        frozen = [c for c in with_vgpu if c.frozen()]  # the harder case, half the time
        c = rng.choice(frozen if frozen and rng.random() < 0.5 else with_vgpu or live)
        shim = shims[c.id]
        c.state, c.gone_at = "killed", time.monotonic()
        self.killed.append((c, c.gone_at, shim))
        self.kills["shims killed"] += 1
        self.run.log(f"FAULT shim-kill9: kill -9 of the shim (pid {shim}) of {c.describe()}, "
                     f"init pid {c.pid}, {c.vgpu_last or 'no vGPU'}"
                     + (", frozen now" if c.frozen() else ""))
        os.kill(shim, signal.SIGKILL)

    def leftovers(self, c, shim, tasks):
        """What is left of a container whose shim was killed, as a list of phrases."""
        left = []
        if c.id in tasks and tasks[c.id][1] != "STOPPED":
            left.append(f"its task is listed {tasks[c.id][1]}")
        if c.pid and alive(c.pid):
            left.append(f"its init (pid {c.pid}) runs")
        if alive(shim):
            left.append(f"its shim (pid {shim}) runs")
        if c.frozen():
            left.append("its cgroup is frozen")
        for path in c.cgroups:
            try:
                with open(os.path.join(os.path.dirname(path), "cgroup.procs")) as f:
                    procs = f.read().split()
            except OSError:
                continue
            if procs:
                left.append(f"{len(procs)} process(es) left in {os.path.dirname(path)}")
                break
        return left

    def tick(self, final=False):
        """The shims killed: judged once containerd cleaned up, or KILL_SETTLE after the kill
        (at once when final)."""
        if not self.killed:
            return
        tasks = self.tasks()
        if tasks is None:
            return  # containerd is down: judged when it answers
        now = time.monotonic()
        for item in list(self.killed):
            c, t, shim = item
            left = self.leftovers(c, shim, tasks)
            if left and now - t < KILL_SETTLE and not final:
                continue
            self.killed.remove(item)
            if c.state == "killed":
                c.state = "exited"  # the generator removes what containerd keeps of it
            if left:
                self.run.violation("shim-kill-leftover", f"{now - t:.1f}s after kill -9 of the shim of "
                                   f"{c.describe()}: {'; '.join(left)}")
            else:
                self.kills["cleaned up"] += 1
                self.kills["slowest cleanup s"] = max(self.kills["slowest cleanup s"], round(now - t, 1))
                self.run.log(f"shim-kill9 of {c.name}: cleaned up within {now - t:.1f}s")

    def clients(self):
        return len(self.shims())

    def summary(self):
        k = self.kills
        return [("containerd", f"{self.restarts} restarts; {k['shims killed']} shims killed, "
                               f"{k['cleaned up']} cleaned up (slowest seen {k['slowest cleanup s']}s)")]
