"""Host-key trust: what the known_hosts files say about a host, and the decision on the key it shows.

known_hosts files are read here line by line as OpenSSH reads them (KnownHosts), not by
paramiko.HostKeys, which fails the whole file on one `@cert-authority` line and knows neither
`@revoked` nor wildcards. Host certificates are not checked (paramiko cannot): a host known only
through a `@cert-authority` line is refused with the way to add its plain key.
"""

from __future__ import annotations

import binascii
import functools
import hmac
import os
import re
import threading
from dataclasses import dataclass
from hashlib import sha1

import paramiko

from orchestrator.config.sshconf import SSH
from orchestrator.core.errors import UserError


class HostKeyError(UserError):
    pass


class RejectUnknown(paramiko.MissingHostKeyPolicy):
    """Decide on a host none of whose usable keys paramiko was given (see connect._open): accept a key the
    known_hosts files list for it; refuse a revoked one, one known only through a CA, and an
    unknown one, each with its fix."""

    def __init__(self, label: str, ssh: SSH, trust: HostTrust | None = None) -> None:
        self.label, self.ssh = label, ssh
        self.trust = trust or host_trust(ssh)

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        problem = self.trust.refusal(self.label, self.ssh, key)
        if problem is not None:
            raise HostKeyError(problem)
        if not self.trust.known(key):
            raise HostKeyError(unknown_key(self.label, self.ssh, hostname, key))


def _keyscan(ssh: SSH, key: paramiko.PKey) -> str:
    """How to check a host's key on the host and then accept it deliberately."""
    return (
        f"Check that fingerprint on the host (ssh-keygen -lf /etc/ssh/ssh_host_"
        f"{key.get_name().split('-')[-1]}_key.pub), then accept it deliberately: ssh-keyscan -p "
        f"{ssh.port} {ssh.hostname} >> {ssh.known_hosts_file}"
    )


def unknown_key(label: str, ssh: SSH, hostname: str, key: paramiko.PKey) -> str:
    return (
        f"{label} ({hostname}): host key unknown ({key.get_name()} {key.fingerprint}), not in "
        f"{', '.join(ssh.known_hosts + ssh.global_known_hosts)}. {_keyscan(ssh, key)}"
    )


MARKERS = ("@cert-authority", "@revoked")


def pattern_matches(name: str, pattern: str) -> bool:
    """One known_hosts host pattern ('*' any run, '?' one character, nothing else special; no
    case) against a host name as ssh looks it up ('host', or '[host]:port' off port 22)."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, name.lower(), re.S) is not None


@functools.lru_cache(maxsize=65536)
def _salted(field: str) -> tuple[bytes, bytes] | None:
    """A hashed host field's salt and hash, decoded once (None: not a valid one)."""
    parts = field.split("|")
    if len(parts) != 4:
        return None
    try:
        return binascii.a2b_base64(parts[2]), binascii.a2b_base64(parts[3])
    except (binascii.Error, ValueError):
        return None


def hosts_match(name: str, field: str) -> bool:
    """Whether a known_hosts line's host field names `name`, as OpenSSH decides: a hashed field
    (|1|salt|hash) by its HMAC; otherwise comma-separated patterns, any one matching, and a
    matching negated one (!pattern) vetoing the whole line."""
    if field.startswith("|1|"):
        salted = _salted(field)
        # ssh looks a host up by its name in lower case; a file written by another tool may not.
        return salted is not None and any(
            hmac.compare_digest(hmac.new(salted[0], n.encode(), sha1).digest(), salted[1])
            for n in {name, name.lower()}
        )
    found = False
    for pattern in field.split(","):
        if pattern.startswith("!"):
            if pattern_matches(name, pattern[1:]):
                return False
        elif pattern and pattern_matches(name, pattern):
            found = True
    return found


@dataclass(frozen=True)
class KnownKey:
    """One usable line of a known_hosts file."""

    marker: str  # "", "@revoked" or "@cert-authority"
    hosts: str  # the host field as written (patterns, or one hashed name)
    key: paramiko.PKey
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


_PLAIN_NAME = re.compile(r"^[^*?!|,]+$")


class KnownHosts(paramiko.HostKeys):
    """A known_hosts file read as OpenSSH reads it, line by line: `@revoked` and `@cert-authority`
    lines kept for what they are, hashed names, wildcards, negations and [host]:port forms matched
    as ssh matches them, and a line that cannot be read (garbage, a key type paramiko does not
    know) skipped on its own. paramiko.HostKeys reads the same file as a whole and fails it, every
    host included, on one `@cert-authority` line (InvalidHostKey: '@cert-authority' is taken as
    the host field, the pattern as the key type and the key type as base64)."""

    def __init__(self, path: str | None = None, text: str = "") -> None:
        super().__init__()
        self.path = path or "known_hosts"
        self.lines: list[KnownKey] = []
        self.skipped: list[int] = []  # line numbers of lines that could not be read
        # Lines naming plain hosts only, by name; the others (patterns, hashes) are matched in turn.
        self._by_name: dict[str, list[KnownKey]] = {}
        self._scan: list[KnownKey] = []
        for number, raw in enumerate(text.splitlines(), 1):
            entry = self._parse(raw, number)
            if entry is None:
                continue
            self.lines.append(entry)
            names = entry.hosts.split(",")
            if all(_PLAIN_NAME.match(n) for n in names):
                for n in names:
                    self._by_name.setdefault(n.lower(), []).append(entry)
            else:
                self._scan.append(entry)

    @classmethod
    def read(cls, path: str) -> KnownHosts:
        with open(path, "rb") as f:
            return cls(path, f.read().decode(errors="replace"))

    def _parse(self, raw: str, number: int) -> KnownKey | None:
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            return None
        marker = ""
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
            if marker not in MARKERS:
                self.skipped.append(number)
                return None
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), number)
        except Exception:  # noqa: BLE001 - bad base64 or key data: this line only, as ssh does
            entry = None
        if entry is None or entry.key is None:
            self.skipped.append(number)
            return None
        return KnownKey(marker, fields[0], entry.key, self.path, number)

    def matching(self, name: str) -> list[KnownKey]:
        """The lines naming `name` ('host', or '[host]:port'), in file order."""
        found = [e for e in self._by_name.get(name.lower(), ()) if hosts_match(name, e.hosts)]
        found += [e for e in self._scan if hosts_match(name, e.hosts)]
        return sorted(found, key=lambda e: e.line) if len(found) > 1 else found

    # paramiko documents lookup as answering a dict of key type to key; its stubs name the private
    # mapping class paramiko itself returns (_SubDict), which no other class can return.
    def lookup(self, hostname: str) -> dict[str, paramiko.PKey] | None:  # type: ignore[override]
        """The plain (unmarked) keys for a host, by type, as paramiko.HostKeys.lookup answers;
        revoked keys left out."""
        found = self.matching(hostname)
        revoked = [e.key for e in found if e.marker == "@revoked"]
        keys: dict[str, paramiko.PKey] = {}
        for e in found:
            if not e.marker and e.key not in revoked:
                keys.setdefault(e.key.get_name(), e.key)
        return keys or None


_KNOWN_HOSTS: dict[str, tuple[tuple[int, int, int], KnownHosts]] = {}
_KNOWN_HOSTS_LOCK = threading.Lock()


def known_hosts(path: str) -> KnownHosts:
    """A known_hosts file (KnownHosts), read again only when it changed (inode, mtime or size);
    empty when there is no such file or it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return KnownHosts(path)
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    with _KNOWN_HOSTS_LOCK:
        cached = _KNOWN_HOSTS.get(path)
    if cached is None or cached[0] != stamp:
        try:
            parsed = KnownHosts.read(path)
        except OSError:  # unreadable (a directory, no permission): no keys, as ssh treats it
            parsed = KnownHosts(path)
        cached = (stamp, parsed)
        with _KNOWN_HOSTS_LOCK:
            _KNOWN_HOSTS[path] = cached
    return cached[1]


@dataclass(frozen=True)
class HostTrust:
    """What a host's known_hosts lines (user and system-wide files) say about it, under the name
    ssh looks it up by."""

    name: str
    keys: tuple[KnownKey, ...]  # plain lines, revoked keys left out
    revoked: tuple[KnownKey, ...]
    authorities: tuple[KnownKey, ...]  # @cert-authority lines (certificates are not checked)

    def known(self, key: paramiko.PKey) -> bool:
        return any(e.key == key for e in self.keys)

    def refusal(self, label: str, ssh: SSH, key: paramiko.PKey) -> str | None:
        """Why `key`, presented by the host, is refused beyond being unknown (None if not)."""
        for e in self.revoked:
            if e.key == key:
                return (
                    f"{label} ({self.name}): host key {key.get_name()} {key.fingerprint} is REVOKED "
                    f"(@revoked line {e.where}); refused, as ssh refuses it. The host needs a new "
                    f"host key: make one there (ssh-keygen -A after removing the old "
                    f"/etc/ssh/ssh_host_{key.get_name().split('-')[-1]}_key*), then check its "
                    f"fingerprint and add it: ssh-keyscan -p {ssh.port} {ssh.hostname} >> "
                    f"{ssh.known_hosts_file}; if the revocation is a mistake, remove line {e.line} "
                    f"of {e.path}"
                )
        if self.authorities and not self.keys:
            first = self.authorities[0]
            return (
                f"{label} ({self.name}): known only through the @cert-authority line {first.where}; "
                f"fabtrain checks host keys with paramiko, which does not verify host certificates, "
                f"so it does not accept CA-signed host keys. Add the host's plain key: "
                f"{_keyscan(ssh, key)}"
            )
        return None


def lookup_name(ssh: SSH) -> str:
    """The name ssh and paramiko look a host's key up by."""
    return ssh.hostname if ssh.port == 22 else f"[{ssh.hostname}]:{ssh.port}"


def host_trust(ssh: SSH) -> HostTrust:
    """What the user's and the system-wide known_hosts files (the same ones sshargs.ssh_options gives
    OpenSSH) say about the host `ssh` reaches."""
    name = lookup_name(ssh)
    found = [e for path in ssh.known_hosts + ssh.global_known_hosts for e in known_hosts(path).matching(name)]
    revoked = tuple(e for e in found if e.marker == "@revoked")
    keys = tuple(e for e in found if not e.marker and not any(r.key == e.key for r in revoked))
    return HostTrust(name, keys, revoked, tuple(e for e in found if e.marker == "@cert-authority"))
