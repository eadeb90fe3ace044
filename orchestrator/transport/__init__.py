"""The SSH transport: one Session over every host (deadlines, jump hosts, host keys), and the
streams of host output it carries (logs)."""
