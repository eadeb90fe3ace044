"""What a running job's lines say: the live board (live) and the end-of-run report (report)."""
