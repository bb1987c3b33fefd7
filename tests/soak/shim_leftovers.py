"""Shims left running when containerd is killed during `ctr run`, for containerd's runc shim and
gpuplex's side by side (docs/benchmarks.md, "The leftover shim"). Root; a containerd of its
own in a temporary directory, no gpuplex annotations (the shims as plain runc shims).

    python3 tests/soak/shim_leftovers.py --bin target/debug --runs 12 --seed 2 --wait 75

Each run: `ctr run -d` of a busybox rootfs, containerd SIGKILLed 0-0.4 s in (seeded), restarted,
then `ctr task rm -f` and `ctr container rm`. --mode remove-after-restart instead lets the run
finish and kills containerd before removing the container. At the end, --wait seconds later
(5), the shim daemons still running are counted per runtime (and then killed); gpuplex's shim
ends by itself a minute after a start containerd never followed with Create (--wait 75).
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time

RUNTIMES = {"io.containerd.runc.v2": "containerd-shim-runc-v2",
            "io.containerd.gpuplex.v1": "containerd-shim-gpuplex-v1"}
NAMESPACE = "leftovers"


def busybox_rootfs(path):
    os.makedirs(os.path.join(path, "bin"))
    for d in ("proc", "sys", "dev", "tmp", "etc"):
        os.makedirs(os.path.join(path, d))
    shutil.copy(shutil.which("busybox"), os.path.join(path, "bin", "busybox"))
    for tool in ("sh", "sleep"):
        os.symlink("busybox", os.path.join(path, "bin", tool))


class Containerd:
    def __init__(self, work, shim):
        self.work, self.sock = work, os.path.join(work, "containerd.sock")
        os.makedirs(os.path.join(work, "bin"))
        os.symlink(shim, os.path.join(work, "bin", RUNTIMES["io.containerd.gpuplex.v1"]))
        with open(os.path.join(work, "config.toml"), "w") as f:
            f.write(f'version = 2\nroot = "{work}/root"\nstate = "{work}/state"\n'
                    'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                    f'[grpc]\n  address = "{self.sock}"\n[ttrpc]\n  address = "{self.sock}.ttrpc"\n'
                    f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{work}/opt"\n')
        with open(os.path.join(work, "runc-options.toml"), "w") as f:
            f.write(f'Root = "{work}/runc"\n')
        self.env = dict(os.environ, PATH=f"{work}/bin:{os.environ['PATH']}")
        self.proc = None

    def start(self):
        with open(os.path.join(self.work, "containerd.log"), "ab") as log:
            self.proc = subprocess.Popen(["containerd", "--config", f"{self.work}/config.toml"],
                                         stdout=log, stderr=log, env=self.env,
                                         start_new_session=True)
        for _ in range(200):
            if os.path.exists(self.sock) and self.ctr("version").returncode == 0:
                return
            time.sleep(0.05)
        raise SystemExit("containerd did not answer within 10 s")

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def ctr_args(self, *args):
        return ["ctr", "--address", self.sock, "--namespace", NAMESPACE] + list(args)

    def ctr(self, *args):
        return subprocess.run(self.ctr_args(*args), capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)


def shim_daemons(binary):
    """{container id: pid} of the shim daemons of `binary` in this script's namespace."""
    out = {}
    for e in os.listdir("/proc"):
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                args = [a.decode() for a in f.read().split(b"\0") if a]
        except (OSError, ValueError):
            continue
        if (args and os.path.basename(args[0]) == binary and "-id" in args
                and NAMESPACE in args and args[-1] not in ("start", "delete")):
            out[args[args.index("-id") + 1]] = int(e)
    return out


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--bin", required=True, help="where containerd-shim-gpuplex-v1 is")
    a.add_argument("--runs", type=int, default=12, help="runs per runtime")
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--wait", type=float, default=5.0,
                   help="seconds after the last run before the shims are counted")
    a.add_argument("--mode", choices=["during-run", "remove-after-restart"], default="during-run")
    o = a.parse_args()
    rng = random.Random(o.seed)
    work = tempfile.mkdtemp(prefix="gpuplex-leftovers.")
    rootfs = os.path.join(work, "rootfs")
    busybox_rootfs(rootfs)
    shim = os.path.abspath(os.path.join(o.bin, RUNTIMES["io.containerd.gpuplex.v1"]))
    c = Containerd(os.path.join(work, "containerd"), shim)
    c.start()
    failed = {}
    try:
        for runtime in RUNTIMES:
            failed[runtime] = []
            for i in range(o.runs):
                cid = f"{runtime.split('.')[2]}-{i}"
                run = ["run", "-d", "--null-io", "--rootfs", "--env", "PATH=/bin", "--runtime",
                       runtime, "--runtime-config-path", f"{c.work}/runc-options.toml", rootfs,
                       cid, "sleep", "1000"]
                if o.mode == "during-run":
                    p = subprocess.Popen(c.ctr_args(*run), stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True)
                    time.sleep(rng.uniform(0.0, 0.4))
                    c.kill()
                    p.communicate(timeout=60)
                    if p.returncode != 0:
                        failed[runtime].append(cid)
                    time.sleep(0.3)
                    c.start()
                else:
                    if c.ctr(*run).returncode != 0:
                        failed[runtime].append(cid)
                    c.kill()
                    time.sleep(0.3)
                    c.start()
                c.ctr("task", "rm", "-f", cid)
                c.ctr("container", "rm", cid)
        time.sleep(o.wait)
        for runtime, binary in RUNTIMES.items():
            left = shim_daemons(binary)
            print(f"{runtime}: {o.runs} runs ({o.mode}, seed {o.seed}), {len(failed[runtime])} "
                  f"ctr run failed, {len(left)} shims left {sorted(left)}")
            for pid in left.values():
                os.kill(pid, signal.SIGKILL)
    finally:
        for cid in c.ctr("container", "ls", "-q").stdout.split():
            c.ctr("task", "rm", "-f", cid)
            c.ctr("container", "rm", cid)
        c.proc.terminate()
        c.proc.wait()
        subprocess.run(["umount", "-R", "-l", work], stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
