"""make soak: the wall clock stepped, then stepped back (the fault `clock-step`).

The node service keeps its windows on the monotonic clock; the wall clock only stamps what
must outlive a process: a reservation's age across a restart, the first vGPU id of a start
(above the clock in milliseconds), the times `gpuplexctl timeline` shows, NVML's samples. The
fault steps CLOCK_REALTIME an hour forward or back, holds it there for a while (a kill -9 of
the service inside the step, half of the time, so that a start reads the stepped clock), then
steps it back by as much: the time that passed meanwhile is kept.

The step in force is written to `clock.offset` in the run's directory before it is made and
removed once it is undone, so that soak.sh's cleanup undoes a step that a crash left
(`python3 clock.py undo WORK`).
"""
import os
import signal
import sys
import time

STEP = 3600.0  # seconds the clock is stepped by
HOLD = (8.0, 15.0)  # seconds it stays stepped (a uniform draw)
OFFSET = "clock.offset"


def shift(seconds):
    """Steps the wall clock by `seconds` (CLOCK_REALTIME; root)."""
    time.clock_settime(time.CLOCK_REALTIME, time.clock_gettime(time.CLOCK_REALTIME) + seconds)


def undo(work):
    """Undoes the step `work/clock.offset` records, if any; the seconds undone."""
    path = os.path.join(work, OFFSET)
    try:
        with open(path) as f:
            offset = float(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0
    if offset:
        shift(-offset)
    os.unlink(path)
    return offset


class ClockStep:
    """The fault; `inject` draws from the faults' generator (node.Faults calls it with it)."""

    def __init__(self, run, svc):
        self.run, self.svc = run, svc
        self.steps = []  # (time, seconds, held, service killed inside)

    def inject(self, rng):
        seconds = rng.choice([STEP, -STEP])
        hold = rng.uniform(*HOLD)
        kill = rng.random() < 0.5
        path = os.path.join(self.run.work, OFFSET)
        with open(path, "w") as f:
            f.write(f"{seconds}\n")
        shift(seconds)
        self.run.log(f"FAULT clock-step: the wall clock stepped {seconds:+.0f}s for {hold:.0f}s"
                     + (", the service killed inside" if kill else ""))
        try:
            if kill and self.svc.up:
                time.sleep(hold / 3)
                self.run.log(f"kill -9 of the service (pid {self.svc.pid}) with the clock stepped")
                os.kill(self.svc.pid, signal.SIGKILL)
                self.svc.dead.wait(10)
                for _ in range(100):  # until the restart, at the stepped clock, answers
                    if self.svc.up:
                        break
                    time.sleep(0.1)
                time.sleep(max(0.0, hold * 2 / 3 - 1))
            else:
                time.sleep(hold)
        finally:
            undo(self.run.work)
            self.run.log(f"the wall clock stepped back {-seconds:+.0f}s")
        self.steps.append((round(self.run.now(), 1), seconds, round(hold, 1), kill))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "undo":
        sys.exit("usage: clock.py undo WORK")
    done = undo(sys.argv[2])
    if done:
        print(f"make soak: undid a wall clock step of {done:+.0f}s that the run left")
