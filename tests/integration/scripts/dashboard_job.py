"""A job for the dashboard's browser test: every rank prints our trainers' step lines (falling loss,
tokens/s) every --step-time seconds for --steps steps, after one log line that attacks whoever
shows it: ESC sequences, a <script> element and an <img> whose onerror would run script. The page
must show that line as text and run nothing. No torch.distributed: only what it prints matters.
"""
import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=400)
p.add_argument("--step-time", type=float, default=0.5)
a = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
node = os.environ.get("GROUP_RANK", "0")
out = sys.stdout
out.write("hostile \x1b[31m<script>window.__pwned = 1; document.title = 'pwned'</script>"
          "<img src=x onerror=\"window.__pwned = 2\">\x1b]0;title\x07 end\n")
out.flush()
for step in range(1, a.steps + 1):
    loss = 4.0 / (1 + 0.05 * step)
    out.write(f"[node{node} rank{rank}] epoch 0 | step {step} | loss {loss:.4f} | lr 1.00e-03 | "
              f"{1000 + 10 * rank:,} tok/s | step 11.0 ms | compute 10.0 ms\n")
    out.flush()
    time.sleep(a.step_time)
