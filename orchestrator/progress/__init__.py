"""What a running job's lines say: the live board (live), the trainers' step lines read (steps) and
the end-of-run report (report)."""
