#!/usr/bin/env python3
"""A CUDA matmul loop for tests/gpu/verify.sh: steady GPU work whose progress can be read from files.

It keeps the GPU busy with fp16 matrix products, `--depth` batches queued ahead, so that at any
moment kernels are in flight (a freeze stops this process's CPU thread; what it already queued
on the GPU still runs). It writes:

- `--log`: every ~100 ms a line `<unix time> <matmuls so far>` (also while it waits);
- `--trace` (optional): one line per completed batch, `<completion time> <matmuls so far>
  <time the batch was queued>`; the completion time is when this process saw the batch done,
  which for a frozen process is only after it was thawed;
- `--ready` (optional): created once CUDA is initialized and the batch size calibrated.

It works only while the `--gate` file exists (when given): with the gate closed it drains its
queue and polls the gate every 5 ms, holding its CUDA context and memory, like a container
between two jobs. SIGTERM or SIGINT end it after flushing its files.

Counts are in matmuls (one `--size`-square fp16 product each), so that loops whose batches
differ in length can be compared; a batch is as many matmuls as take about `--batch-ms`.
"""

import argparse
import collections
import os
import signal
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True, help="progress log, a line every ~100 ms")
    p.add_argument("--trace", help="one line per completed batch")
    p.add_argument("--gate", help="work only while this file exists")
    p.add_argument("--ready", help="created once initialized")
    p.add_argument("--size", type=int, default=4096, help="matrix side (default 4096)")
    p.add_argument("--batch-ms", type=float, default=5.0, help="target batch length in ms")
    p.add_argument("--depth", type=int, default=2, help="batches queued ahead (default 2)")
    p.add_argument("--device", default="cuda:0", help="torch device (default cuda:0)")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    return p.parse_args(argv)


class Writer:
    """Buffered progress output, flushed every `every` seconds and at exit."""

    def __init__(self, log_path, trace_path, every=0.1):
        self.log = open(log_path, "a", buffering=1, encoding="ascii")
        self.trace = open(trace_path, "a", encoding="ascii") if trace_path else None
        self.pending = []
        self.every = every
        self.next_flush = 0.0

    def batch(self, done_at, total, queued_at):
        if self.trace:
            self.pending.append("%.6f %d %.6f\n" % (done_at, total, queued_at))

    def tick(self, now, total, force=False):
        if not force and now < self.next_flush:
            return
        self.next_flush = now + self.every
        if self.trace and self.pending:
            self.trace.write("".join(self.pending))
            self.trace.flush()
            self.pending.clear()
        self.log.write("%.6f %d\n" % (now, total))

    def close(self, total):
        self.tick(time.time(), total, force=True)
        self.log.close()
        if self.trace:
            self.trace.close()


def main(argv):
    args = parse_args(argv)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))

    import torch  # late: --help works without torch

    if not torch.cuda.is_available():
        print("matmul.py: torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    a = torch.randn(args.size, args.size, device=device, dtype=torch.float16)
    b = torch.randn(args.size, args.size, device=device, dtype=torch.float16)
    c = torch.empty_like(a)

    # Warm up, then calibrate how many matmuls make a batch of about --batch-ms.
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize(device)
    one_ms = max((time.perf_counter() - start) * 100.0, 1e-3)
    per_batch = int(min(64, max(1, round(args.batch_ms / one_ms))))

    out = Writer(args.log, args.trace)
    total = 0
    queue = collections.deque()  # (event, matmuls, queued_at)

    def retire():
        nonlocal total
        event, n, queued_at = queue.popleft()
        event.synchronize()
        total += n
        out.batch(time.time(), total, queued_at)

    if args.ready:
        with open(args.ready, "w", encoding="ascii") as f:
            f.write("%d matmuls of %d per batch, %.3f ms each\n" % (per_batch, args.size, one_ms))
    deadline = time.time() + args.seconds if args.seconds > 0 else None
    while not stop and (deadline is None or time.time() < deadline):
        now = time.time()
        out.tick(now, total)
        if args.gate and not os.path.exists(args.gate):
            while queue:
                retire()
            time.sleep(0.005)
            continue
        queued_at = time.time()
        for _ in range(per_batch):
            torch.matmul(a, b, out=c)
        event = torch.cuda.Event()
        event.record()
        queue.append((event, per_batch, queued_at))
        while len(queue) > max(1, args.depth):
            retire()
    while queue:
        retire()
    out.close(total)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
