"""make demo's last table: the share of the GPU each container got, next to its weight.

Reads `gpuplexctl status -o json` on stdin.
"""
import json
import sys

status = json.load(sys.stdin)
containers = sorted(status["containers"], key=lambda c: c["weight"])
total = sum(c["gpu_seconds"] for c in containers) or 1.0
weights = sum(c["weight"] for c in containers) or 1
print(f"{'container':<14}{'weight':>7}{'share':>9}{'fair':>8}{'windows':>9}")
for c in containers:
    share = 100 * c["gpu_seconds"] / total
    fair = 100 * c["weight"] / weights
    print(f"{c['id'][:12]:<14}{c['weight']:>7}{share:>8.1f}%{fair:>7.1f}%{c['windows']:>9}")
