"""Command building: pure functions from the inventory and a JobSpec to the exact argv and shell
text run on a host (dockerargs, hostfiles) or on this machine (sshargs)."""
