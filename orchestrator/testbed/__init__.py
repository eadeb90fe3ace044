"""The local cluster of Docker-in-Docker test hosts (fab cluster.up)."""
