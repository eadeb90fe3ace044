"""The pure core: what a job is (jobspec), its record (recovery), the decisions after a failure
(policy), the events it reports, and the one place per kind where what hosts send back is made safe
(hostile). Nothing here does I/O or imports another layer (tests/unit/test_layers.py)."""
