"""make soak: the node service under a stand-in for systemd, the node socket, and the faults.

`Service` plays systemd's `Restart=always`: it starts `containerd-shim-gpuplex-v1 serve`, and
whenever the process dies it restarts it `RESTART_DELAY` seconds later, logging each restart.
It also plays `gpuplex.socket`: it listens on the node socket itself, from the start to the end
of the run, and passes it to every service it starts (fd 3, `LISTEN_FDS`, `LISTEN_PID`), so that
a request sent while the service is down waits for the next one, as under systemd.
Just before a restart it checks the fail-open rule: a service gone for a second has left no
container frozen (unless its watchdog was killed with it: then the next start thaws).
The containerd shim starts a service itself when a container asks for a vGPU and none answers
(shim/src/task/node_link.rs); a service that holds the node lock when the supervisor would start
one (or that took it first, so that the supervisor's own start waits and refuses) is adopted:
watched by its pid, killed by the faults, stopped at the end like one of the supervisor's.
`Faults` injects the seeded faults at their planned moments; the parts add theirs (extra).
"""
import errno
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

RESTART_DELAY = 1.2  # seconds from a death to the restart (systemd's RestartSec)
GONE_CHECK = 1.0  # seconds after a death when nothing may be frozen any more
KINDS = ["kill9", "kill9-both", "sigstop", "truncate", "statedir-full"]


def request(path, line, timeout=5.0):
    """One request line on the node socket: (reply as a dict, seconds it took)."""
    t = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line.encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("the service closed the connection without a reply")
            buf += chunk
    return json.loads(buf), time.monotonic() - t


def listen(path):
    """The node socket, listening, mode 0600, as systemd makes it for gpuplex.socket."""
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    s.listen(128)
    return s


def alive(pid):
    """Whether pid is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, TypeError, IndexError):
        return False


class Service:
    """The node service, restarted like a systemd unit with Restart=always."""

    def __init__(self, run, binary, config, socket_path, log_path, state_dir, frozen_now):
        self.run, self.binary, self.config = run, binary, config
        self.socket, self.log_path, self.state_dir = socket_path, log_path, state_dir
        self.frozen_now = frozen_now  # callable: names of the containers frozen now
        self.proc = None
        self.pid = None
        self.watchdog_pid = None
        self.up = False  # its process runs and its socket answered
        self.stopped = False  # SIGSTOPped by a fault
        self.up_since = None  # monotonic time it last became up
        self.expect_frozen = False  # its watchdog dies with it: the next start thaws
        self.hold = threading.Event()  # set: do not restart (a fault works on its state_dir)
        self.dead = threading.Event()  # set while no service process runs
        self.quit = False
        self.restarts = 0
        self.failed_starts = 0
        self.adopted = 0  # services a shim started that the supervisor took over
        self.lifetimes = []  # {"pid", "start", "end", "samples": [(t, n, fds, threads, rss_kb)]}
        self.log_offset = 0
        self.listener = None  # the node socket, listened on as gpuplex.socket does

    def start(self):
        """Starts the service and waits (10 s at most) for its socket to answer; or adopts the
        one a shim started (already serving, or serving first while ours waits for the lock)."""
        holder = self.serving()
        if holder:
            self.adopt(holder)
            return
        self.log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        if self.listener is None:
            self.listener = listen(self.socket)
        fd = self.listener.fileno()
        # The shell exports its own pid (the service's, after exec) and moves the socket to fd 3.
        activate = f'export LISTEN_PID=$$ LISTEN_FDS=1; exec "$@" 3<&{fd} {fd}<&-'
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["sh", "-c", activate, "sh", self.binary, "serve", "--config", self.config],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=(fd,), env=dict(os.environ, NO_COLOR="1"))
        self.pid = self.proc.pid
        self.dead.clear()
        self.run.write_file("service.pid", str(self.pid))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                request(self.socket, '{"op":"status"}', timeout=2)
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        else:
            holder = self.serving()
            if holder:
                self.adopt(holder)
            elif self.proc.poll() is None:
                self.run.log(f"service pid {self.pid}: its socket does not answer after 10 s")
            return
        holder = self.serving()
        if holder and holder != self.pid:
            # A shim's service answered: ours waits for the node lock, and refuses after 5 s.
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.run.log(f"service pid {self.pid} gave way ({describe(self.proc.returncode)}): "
                         f"pid {holder} holds the node lock")
            self.adopt(holder)
            return
        self.watchdog_pid = self.find_watchdog()
        self.run.write_file("watchdog.pid", str(self.watchdog_pid or ""))
        self.up, self.up_since = True, time.monotonic()
        self.lifetimes.append({"pid": self.pid, "start": self.run.now(), "end": None, "samples": []})
        self.run.log(f"service up: pid {self.pid}, watchdog pid {self.watchdog_pid}")

    def adopt(self, pid):
        """Takes over a service this supervisor did not start (a shim's)."""
        self.proc, self.pid = None, pid
        self.adopted += 1
        self.dead.clear()
        self.run.write_file("service.pid", str(pid))
        self.watchdog_pid = self.find_watchdog()
        self.run.write_file("watchdog.pid", str(self.watchdog_pid or ""))
        self.up, self.up_since = True, time.monotonic()
        self.lifetimes.append({"pid": pid, "start": self.run.now(), "end": None, "samples": [],
                               "adopted": True})
        self.run.log(f"service up: pid {pid}, started by a containerd shim (adopted; its log is "
                     f"{os.path.join(os.path.dirname(self.socket), 'service.log')}), watchdog pid "
                     f"{self.watchdog_pid}")

    def lock_holder(self):
        """The pid /proc/locks gives for the node lock's holder (not a waiter), or None."""
        try:
            st = os.stat(os.path.join(self.state_dir, "lock"))
            with open("/proc/locks") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in lines:
            f = line.split()
            if len(f) >= 6 and f[1] != "->" and f[5] == want:
                return int(f[4])
        return None

    def serving(self):
        """The pid of a live `serve` of this config that holds the node lock, or None."""
        pid = self.lock_holder()
        if pid is None or not alive(pid):
            return None
        args = cmdline(pid)
        return pid if "serve" in args and self.config in args else None

    def find_watchdog(self):
        """The pid of the service's watchdog (`watchdog --state-dir DIR`, its child), or None."""
        for e in os.listdir("/proc"):
            if not e.isdigit():
                continue
            args = cmdline(e)
            if "watchdog" in args[1:2] and self.state_dir in args and parent(e) == self.pid:
                return int(e)
        return None

    def wait(self):
        """Until the service dies: its exit code (None when it is not our child)."""
        if self.proc is not None:
            return self.proc.wait()
        while alive(self.pid):
            time.sleep(0.05)
        return None

    def supervise(self):
        """The thread: start, wait for the death, check, restart; until quit."""
        self.start()
        while not self.quit:
            code = self.wait()
            died = time.monotonic()
            was_up, injected = self.up, self.run.fault_active()
            self.up, self.stopped = False, False
            if self.lifetimes and self.lifetimes[-1]["pid"] == self.pid:
                self.lifetimes[-1]["end"] = self.run.now()
            if self.quit:
                self.dead.set()
                break
            down = self.run.fault_begin("service-down")
            self.dead.set()
            self.run.log(f"service pid {self.pid} died ({describe(code)})")
            if not injected:
                what = "ended" if was_up else "did not start"
                self.run.violation("service-died", f"the service (pid {self.pid}) {what} with no fault "
                                   f"injected: {describe(code)}; its last lines: {self.tail()}")
            self.gone_check(died)
            while time.monotonic() < died + RESTART_DELAY or self.hold.is_set():
                if self.quit:
                    return
                time.sleep(0.05)
            self.restarts += 1
            self.run.log(f"restarting the service (restart {self.restarts}, as Restart=always)")
            self.start()
            if not self.up:
                self.failed_starts += 1
            self.run.fault_end("service-down", down)

    def tail(self, n=3):
        """The service log's last lines, on one line."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self.log_offset, os.path.getsize(self.log_path) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(re.sub(r"\x1b\[[0-9;]*m", "", x) for x in lines[-n:])

    def gone_check(self, died):
        """One second after the death: nothing frozen, unless the watchdog died too."""
        time.sleep(max(0.0, died + GONE_CHECK - time.monotonic()))
        if self.serving():
            self.run.log(f"a service (pid {self.serving()}, a shim's) runs again {GONE_CHECK}s after "
                         "the death: its windows may freeze, nothing to check")
            self.expect_frozen = False
            return
        frozen = self.frozen_now()
        self.run.count_check("frozen-after-service-gone")
        if frozen and self.expect_frozen:
            self.run.log(f"{len(frozen)} container(s) frozen with service and watchdog gone "
                         "(expected: the next start thaws them)")
        elif frozen:
            self.run.violation("frozen-after-service-gone",
                               f"{GONE_CHECK}s after the service died, still frozen: {', '.join(frozen)}")
        self.expect_frozen = False

    def sample(self, n_containers, n_clients=0, n_procs=0):
        """Its fds, threads, RSS and connections (socket fds but the listener), kept with this
        lifetime with the numbers of containers, of long-lived clients (shims) and of the
        containers' processes beside them, and its fds by kind: (t, containers, fds, threads,
        rss_kb, connections, clients, pidfds, cgroup files, other fds, processes, /proc files),
        or None."""
        if not self.up or not self.lifetimes:
            return None
        kinds = {"socket": 0, "pidfd": 0, "cgroup": 0, "proc": 0, "other": 0}
        try:
            fds = os.listdir(f"/proc/{self.pid}/fd")
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                except OSError:
                    continue
                kinds["socket" if target.startswith("socket:") else "pidfd"
                      if target == "anon_inode:[pidfd]" else "cgroup"
                      if target.startswith("/sys/fs/cgroup/") else "proc"
                      if target.startswith("/proc/") else "other"] += 1
            with open(f"/proc/{self.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            threads = int(fields["Threads"])
            rss = int(fields["VmRSS"].split()[0])
        except (OSError, KeyError, ValueError):
            return None
        life = self.lifetimes[-1]
        s = (round(self.run.now() - life["start"], 2), n_containers, len(fds), threads, rss,
             kinds["socket"] - 1, n_clients, kinds["pidfd"], kinds["cgroup"], kinds["other"], n_procs,
             kinds["proc"])
        life["samples"].append(s)
        return s

    def stop(self):
        """SIGTERM (it thaws what it froze), as at the end of the run; SIGKILL after 15 s."""
        self.quit = True
        if self.proc and self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif self.proc is None and self.pid and alive(self.pid):  # adopted
            for sig in (signal.SIGCONT, signal.SIGTERM):
                os.kill(self.pid, sig)
            for _ in range(150):
                if not alive(self.pid):
                    break
                time.sleep(0.1)
            else:
                os.kill(self.pid, signal.SIGKILL)
        if self.lifetimes and self.lifetimes[-1]["end"] is None:
            self.lifetimes[-1]["end"] = self.run.now()
        self.up = False
        if self.listener is not None:  # gpuplex.socket stopped: no one waits any more
            self.listener.close()
            self.listener = None


def describe(code):
    if code is None:
        return "not the supervisor's child: exit status unknown"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def cmdline(pid):
    """A process's arguments ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def plan(rng, seconds, mean_gap, kinds, quiet_start=20.0, quiet_end=20.0):
    """The seeded faults: (offset in seconds, kind). The first round has each kind once, in a
    shuffled order, one in each of len(kinds) equal slots of min(the run, len(kinds) mean gaps),
    so that even a short run sees every kind; after it, exponential gaps of mean_gap and kinds
    at random."""
    first = list(kinds)
    rng.shuffle(first)
    usable = seconds - quiet_start - quiet_end
    if usable <= 0:
        return []
    span = min(usable, len(first) * mean_gap)
    slot = span / len(first)
    out = [(round(quiet_start + i * slot + rng.uniform(0.2, 0.8) * slot, 1), k)
           for i, k in enumerate(first)]
    t = quiet_start + span
    while True:
        t += rng.expovariate(1.0 / mean_gap)
        if t > seconds - quiet_end:
            return out
        out.append((round(t, 1), rng.choice(kinds)))


class Faults:
    """Injects the planned faults; each logged with its time and kept as a window. The node
    service's own (KINDS) are methods here; `extra` maps a part's kinds to its callables
    (called with this rng)."""

    def __init__(self, run, svc, state_dir, schedule, rng, extra=None):
        self.run, self.svc, self.state_dir = run, svc, state_dir
        self.schedule, self.rng = schedule, rng
        self.quit = False
        self.handlers = {k: getattr(self, k.replace("-", "_").replace("kill9", "kill")) for k in KINDS}
        self.handlers |= {k: (lambda f=f: f(self.rng)) for k, f in (extra or {}).items()}
        self.done = {k: 0 for k in self.handlers}
        self.truncated = []  # (time, file, vgpu id) of truncated records

    def loop(self):
        for at, kind in self.schedule:
            while self.run.now() < at:
                if self.quit:
                    return
                time.sleep(0.1)
            if not self.svc.up:  # wait (10 s at most) for a service to hurt
                for _ in range(100):
                    if self.svc.up or self.quit:
                        break
                    time.sleep(0.1)
            if self.quit or not self.svc.up:
                continue
            start = self.run.fault_begin(kind)
            try:
                self.handlers[kind]()
                self.done[kind] += 1
            finally:
                self.run.fault_end(kind, start)

    def wait_dead(self):
        self.svc.dead.wait(10)

    def kill(self):
        self.run.log(f"FAULT kill9: kill -9 of the service (pid {self.svc.pid})")
        os.kill(self.svc.pid, signal.SIGKILL)
        self.wait_dead()

    def kill_both(self):
        wd = self.svc.find_watchdog()
        try:
            with open(f"/proc/{wd}/cmdline", "rb") as f:
                ok = b"watchdog" in f.read()
        except (OSError, TypeError):
            ok = False
        self.run.log(f"FAULT kill9-both: kill -9 of the watchdog (pid {wd}) and the service (pid {self.svc.pid})")
        if not ok:
            self.run.log(f"the watchdog pid {wd} is no watchdog now; killing the service alone")
        self.svc.expect_frozen = ok
        if ok:
            os.kill(wd, signal.SIGKILL)
        os.kill(self.svc.pid, signal.SIGKILL)
        self.wait_dead()

    def sigstop(self):
        self.run.log(f"FAULT sigstop: SIGSTOP of the service (pid {self.svc.pid}) for 5 s")
        self.svc.stopped = True
        os.kill(self.svc.pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(self.svc.pid, signal.SIGCONT)
        self.svc.stopped = False
        self.run.log("SIGCONT of the service")

    def truncate(self):
        self.svc.hold.set()
        try:
            self.run.log(f"FAULT truncate: kill -9 of the service (pid {self.svc.pid}), a record torn while it is down")
            os.kill(self.svc.pid, signal.SIGKILL)
            self.wait_dead()
            names = sorted(n for n in os.listdir(self.state_dir) if n.startswith("vgpu-") and n.endswith(".json"))
            if not names:
                names = sorted(n for n in os.listdir(self.state_dir) if n.endswith(".json"))
            if not names:
                self.run.log("no state file to truncate")
                return
            name = self.rng.choice(names)
            path = os.path.join(self.state_dir, name)
            size = os.path.getsize(path)
            keep = self.rng.randrange(size) if size else 0
            os.truncate(path, keep)
            self.truncated.append((self.run.now(), name, name[:-5]))
            self.run.log(f"truncated {name} from {size} to {keep} bytes")
        finally:
            self.svc.hold.clear()
        for _ in range(100):  # until the restart answers
            if self.svc.up:
                break
            time.sleep(0.1)

    def statedir_full(self):
        path = os.path.join(self.state_dir, "soak-fill")
        written = 0
        self.run.log("FAULT statedir-full: state_dir filled for 10 s")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            chunk = b"\0" * 65536
            while True:
                written += os.write(fd, chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                self.run.log(f"cannot fill state_dir: {e}")
        finally:
            os.close(fd)
        self.run.log(f"state_dir full ({written} bytes of filler)")
        time.sleep(10)
        os.unlink(path)
        self.run.log("state_dir freed")
