"""Benchmark: the CPU spent on known_hosts per command, by hosts and by the file's size.

    .venv/bin/python tests/bench/known_hosts.py --hosts 8,64,512 --entries 64,1000 --repeat 5

Each of a command's N connections used to parse the whole known_hosts file (paramiko
SSHClient.load_host_keys): N hosts x E entries, and a fleet's known_hosts grows with the fleet.
Now each file is parsed once (hostkeys.known_hosts) and each connection gets only its host's
entries. Both are timed here side by side on the same generated file (ed25519 keys, unhashed
names as ssh-keyscan writes them), CPU seconds of this process, median of --repeat. No network.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.transport import hostkeys  # noqa: E402


def write_file(path: Path, entries: int) -> list[str]:
    names = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(entries)]
    with open(path, "w") as f:
        for name in names:
            key = (
                ed25519.Ed25519PrivateKey.generate()
                .public_key()
                .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                .decode()
            )
            f.write(f"{name} {key}\n")
    return names


def per_connection(path: str, names: list[str]) -> None:
    for _ in names:
        paramiko.SSHClient().load_host_keys(path)


def parsed_once(path: str, names: list[str]) -> None:
    hostkeys._KNOWN_HOSTS.clear()  # the first connection of the command parses the file
    for name in names:
        mine = paramiko.SSHClient().get_host_keys()
        for key_type, key in (hostkeys.known_hosts(path).lookup(name) or {}).items():
            mine.add(name, key_type, key)


def cpu(fn, *args) -> float:
    t = time.process_time()
    fn(*args)
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="8,64,512")
    ap.add_argument("--entries", default="64,1000")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'entries':>7}  {'hosts':>5}  {'per connection':>14}  {'parsed once':>11}  {'ratio':>6}")
    for entries in (int(x) for x in args.entries.split(",")):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "known_hosts"
            names = write_file(path, entries)
            for n in (int(x) for x in args.hosts.split(",")):
                hosts = [names[i % entries] for i in range(n)]
                old, new = [], []
                for _ in range(args.repeat):  # alternated, so both see the same machine
                    old.append(cpu(per_connection, str(path), hosts))
                    new.append(cpu(parsed_once, str(path), hosts))
                o, w = statistics.median(old), statistics.median(new)
                print(f"{entries:>7}  {n:>5}  {o:>13.3f}s  {w:>10.3f}s  {o / w:>5.0f}x", flush=True)


if __name__ == "__main__":
    main()
