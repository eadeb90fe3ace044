"""A program that attacks the terminal of whoever runs fab, as a downloaded script could:
- its rank name (in our trainers' step-line format, which fab's end-of-run table and straggler
  line read) and its log lines carry OSC-52 (write the clipboard), clear-screen, C1 controls and
  rich markup (`[/red]`, `[link=file:///etc/passwd]`);
- rank 0 prints --big-mb MB with no newline;
- then it waits for $FABTRAIN_OUTPUT/release (the test creates it) before its last lines, so
  that the test can act while the job runs.
No torch.distributed: the attacks are in what it prints.
"""
import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--big-mb", type=int, default=256)
p.add_argument("--wait", type=float, default=120)
a = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
EVIL = "\x1b]52;c;cGF5bG9hZA==\x07\x1b[2J\u009b31m[/red][link=file:///etc/passwd]x[/link]"
name = f"{EVIL}node{rank}"
out = sys.stdout
for step in range(1, 6):
    # rank 1 is three times slower: a straggler line names it.
    compute = 30.0 if rank == 1 else 10.0
    out.write(f"[{name} rank{rank}] epoch 0 | step {step} | loss 2.0 | lr 1.00e-03 | 1,000 tok/s | "
              f"step {compute + 1:.1f} ms | compute {compute:.1f} ms\n")
    out.write(f"log line {step} {EVIL}\n")
out.flush()
if rank == 0 and a.big_mb:
    chunk = "A" * (1 << 20)
    for _ in range(a.big_mb):
        out.write(chunk)
    out.write("\n")
    out.flush()
print(f"BIG DONE rank {rank}", flush=True)
release = os.path.join(os.environ.get("FABTRAIN_OUTPUT", "/output"), "release")
deadline = time.monotonic() + a.wait
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.2)
print(f"released rank {rank}: {os.path.exists(release)}", flush=True)
