"""make soak: podman as a part of the run (a runtime the generator starts containers through).

A part is what workload.Workload drives; each runtime is one (this one, containerd.py):
  name                 its name in the logs and the summary
  start() / stop()     its daemons, if any (podman has none); start returns False when it cannot
  run_container(c)     starts c detached; sets c.id and c.pid; returns (ok, error line)
  remove(c, graceful)  stops and removes a live c; returns (ok, why)
  remove_gone(c)       removes what is left of a c that exited
  remove_all()         the end: every container of the part removed; returns its problems
  fault_kinds          {kind: callable(rng)}: the faults it injects (node.Faults plans them)
  tick()               called by the checker every second: the part's own invariants
  clients()            how many long-lived clients of the node socket it runs now (shims)
  summary()            rows (name, value) for the summary table
podman runs gpuplex through its hooks.d (precreate, createRuntime, poststop).
"""
import subprocess


def last_line(text):
    """The last line that says something (the runtime's words before it dropped)."""
    line = ([x for x in text.splitlines() if x.strip()] or ["(no message)"])[-1].strip()
    return line.split("stderr: ", 1)[-1]  # the hook's own line, after runc's words


class Podman:
    name = "podman"

    def __init__(self, run, podman_dir, rootfs, cpus):
        pd = podman_dir
        self.cmd = ["env", f"CONTAINERS_CONF={pd}/containers.conf", "podman", "--root", f"{pd}/root",
                    "--runroot", f"{pd}/runroot", "--tmpdir", f"{pd}/tmp", "--storage-driver", "vfs"]
        self.run, self.rootfs, self.cpus = run, rootfs, cpus
        self.fault_kinds = {}

    def pm(self, *args, timeout=90):
        return subprocess.run(self.cmd + list(args), capture_output=True, text=True, timeout=timeout)

    def start(self):
        return True

    def stop(self):
        pass

    def tick(self):
        pass

    def clients(self):
        return 0  # the hooks' connections last one request

    def summary(self):
        return []

    def run_container(self, c):
        args = ["run", "-d", "--name", c.name, "--runtime", "runc", "--network", "none"]
        if self.cpus:
            args += ["--cpus", self.cpus]
        for k, v in c.annotations().items():
            args += ["--annotation", f"{k}={v}"]
        args += ["--rootfs", self.rootfs, "sh", "-c", c.script]
        try:
            p = self.pm(*args)
        except subprocess.TimeoutExpired:
            self.pm("rm", "-f", "-t", "0", c.name)
            return False, "podman run took over 90 s"
        if p.returncode != 0:
            self.pm("rm", "-f", "-t", "0", c.name)
            return False, last_line(p.stderr)
        c.id = p.stdout.strip().splitlines()[-1]
        p = self.pm("inspect", "--format", "{{.State.Pid}}", c.id, timeout=30)
        try:
            c.pid = int(p.stdout.strip())
        except ValueError:
            c.pid = None
        return True, ""

    def remove(self, c, graceful):
        """podman stop -t 2 then rm (graceful), or rm -f -t 0."""
        try:
            if graceful:
                self.pm("stop", "-t", "2", c.id)
            p = self.pm("rm", "-f", "-t", "0", c.id)
            return p.returncode == 0, p.stderr.strip()
        except subprocess.TimeoutExpired:
            return False, "podman rm took over 90 s"

    def remove_gone(self, c):
        self.pm("rm", "-f", "-t", "0", c.id)

    def remove_all(self):
        p = self.pm("rm", "-a", "-f", "-t", "0", timeout=300)
        return [] if p.returncode == 0 else [f"podman rm -a -f: {p.stderr.strip()}"]
