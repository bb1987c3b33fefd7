"""make soak: Kubernetes pods through the kubelet's plugins (kubelet.py), as a generator of its own.

Claim pods (a ResourceClaim prepared by the DRA driver, its 1-3 containers sharing the claim's
vGPU) and device-plugin allocation pods are kept between SOAK_PODS' two bounds, created and
removed at seeded random beside the containers of workload.py. Its fault, `dra-restart`: kill
-9 of the DRA driver while a prepare waits for its claim (two times in three), else of the
device plugin; both are started again and registered, and the kubelet retries. Its invariants
are the kubelet's own (Kubelet.check: every running claim and allocation has exactly its vGPU,
placed and sized as asked, its containers attached to it; none once it is gone or its units
given again), checked every second while the run is settled; checks.py leaves the node's
entries that carry a claim to them, and counts their memory once per vGPU.
"""
import random
import threading
import time

from kubelet import REFUSED, ClaimPod, Kubelet, KubeletError


class Pods:
    name = "kubelet"

    def __init__(self, run, work, bin_dir, podman, rootfs, cpus, seed, lo, hi, mean_gap, run_id):
        self.run, self.lo, self.hi, self.mean_gap = run, lo, hi, mean_gap
        self.rng = random.Random(seed * 7 + 3)  # the generator's choices
        self.kubelet = Kubelet(work=f"{work}/kubelet", bin_dir=bin_dir,
                               node_config=f"{work}/gpuplex.toml", node_socket=f"{work}/gpuplex.sock",
                               podman=podman, rootfs=rootfs, log=run.log, cpus=cpus,
                               rng=random.Random(seed * 7 + 5), run_id=run_id)
        self.fault_kinds = {"dra-restart": self.fault_restart}
        self.quit = False
        self.counts = {"claim pods": 0, "allocation pods": 0, "removed": 0, "refused": 0,
                       "failed during a fault": 0}
        self.reported = set()

    def start(self):
        try:
            self.kubelet.start()
            return True
        except KubeletError as e:
            self.run.log(f"kubelet: {e}")
            return False

    def running(self):
        k = self.kubelet
        with k.lock:
            return [p for p in k.claims + k.allocs if p.state == "running"]

    def loop(self):
        """The generator: fill to the low mark, then create or remove at random, until quit."""
        while not self.quit:
            live = self.running()
            n = len(live)
            create = n < self.lo or (n < self.hi and self.rng.random() < 0.5)
            if create:
                self.create(self.rng.random() < 0.6)
            else:
                self.remove(self.rng.choice(live))
            if n >= self.lo:
                time.sleep(self.rng.expovariate(1.0 / self.mean_gap))

    def create(self, claim):
        t0 = self.run.now()
        k = self.kubelet
        try:
            if claim:
                pod = k.create_claim_pod(weight=self.rng.randint(1, 4))
                self.counts["claim pods"] += 1
            else:
                pod = k.allocate_pod()
                self.counts["allocation pods"] += 1
            self.run.log(f"kubelet: started {pod.describe()}")
        except KubeletError as e:
            line = str(e)
            if REFUSED.search(line) or "free on GPUs" in line:
                self.counts["refused"] += 1
                self.run.log(f"kubelet: refused: {line}")
            elif self.run.fault_near(t0, self.run.now()):
                self.counts["failed during a fault"] += 1
                self.run.log(f"kubelet: failed during a fault: {line}")
            else:
                self.run.violation("pod-failed", line)

    def remove(self, pod):
        t0 = self.run.now()
        k = self.kubelet
        try:
            if isinstance(pod, ClaimPod):
                k.remove_claim_pod(pod)
            else:
                k.release_pod(pod)
            self.counts["removed"] += 1
            self.run.log(f"kubelet: removed {pod.describe()}")
        except KubeletError as e:
            if self.run.fault_near(t0, self.run.now()):
                self.run.log(f"kubelet: removal failed during a fault: {e}")
            else:
                self.run.violation("pod-remove-failed", str(e))

    def fault_restart(self, rng):
        kind = "dra" if rng.random() < 2 / 3 else "device-plugin"
        self.run.log(f"FAULT dra-restart: kill -9 of gpuplex-dra ({kind})")
        try:
            record = self.kubelet.restart_plugin(mid_prepare=kind == "dra", kind=kind)
        except KubeletError as e:
            self.run.violation("dra-restart", str(e))
            return
        if record.get("error") and not REFUSED.search(record["error"]):
            self.run.violation("dra-restart", f"the pod admitted during the restart did not run: "
                               f"{record['error']}")

    def check(self, status):
        """The kubelet's invariants against the node's status (the checker calls it settled)."""
        self.run.count_check("kubelet")
        for kind, key, msg in self.kubelet.check(status):
            if (kind, key) not in self.reported:
                self.reported.add((kind, key))
                self.run.violation(kind, msg)

    def drain(self):
        """The end: every pod removed, lingering allocations released; problems as violations."""
        for kind, key, msg in self.kubelet.drain():
            self.run.violation(kind, msg)

    def stop(self):
        self.kubelet.stop()

    def summary(self):
        s = self.kubelet.summary()
        return [("kubelet pods", ", ".join(f"{k} {v}" for k, v in self.counts.items())),
                ("kubelet plugins", f"{s['plugin_restarts']} restarts, {s['restarts_mid_prepare']} "
                                    f"with a prepare in flight; {s['superseded']} allocations "
                                    "superseded when their units were given again")]


def start_thread(pods):
    t = threading.Thread(target=pods.loop, name="pods", daemon=True)
    t.start()
    return t
