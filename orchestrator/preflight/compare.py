"""Phase 2 of a preflight, its second half: once each host is judged on its own (judge), the hosts
against each other (`judge_across`: same image id, same MTU, same code as this machine). Pure, so
unit-tested without a network."""

from __future__ import annotations

from collections import Counter

from orchestrator.config.inventory import Inventory
from orchestrator.preflight.checks import FAIL, OK, WARN, Check
from orchestrator.preflight.judge import describe_image


def judge_across(inv: Inventory, per_host: dict[str, dict], local_code: str | None) -> list[Check]:
    """Checks that compare hosts: same image id, same MTU, the same code as this machine."""
    return _image_checks(per_host) + _mtu_checks(per_host) + _code_checks(per_host, local_code)


def _image_checks(per_host: dict[str, dict]) -> list[Check]:
    """The hosts whose image id differs from the most hosts' (same tag, other image); where none
    does, the hosts whose python/torch/CUDA/ROCm versions differ from the most common ones."""
    out: list[Check] = []
    ids = {n: f["image_id"] for n, f in per_host.items() if f.get("image_id")}
    if len(set(ids.values())) > 1:
        groups: dict[str, list[str]] = {}
        for n, i in ids.items():
            groups.setdefault(i, []).append(n)
        majority = max(groups.values(), key=len)
        for n, i in ids.items():
            if n not in majority:
                out.append(
                    Check(
                        n,
                        "image",
                        FAIL,
                        f"image id {i[7:19]} differs from {majority[0]}'s "
                        f"{ids[majority[0]][7:19]} (same tag, other image)",
                        f"fab image.push to {n}, so every host runs the same image",
                    )
                )
    if not out:  # same image everywhere, or per-host images: their contents must still agree
        versions = {
            n: describe_image(f["image_info"])
            for n, f in per_host.items()
            if f.get("image_info") and "error" not in f["image_info"]
        }
        if len(set(versions.values())) > 1:
            common = Counter(versions.values()).most_common(1)[0][0]
            for n, v in versions.items():
                if v != common:
                    out.append(
                        Check(
                            n,
                            "image",
                            WARN,
                            f"{v} here, {common} on the others",
                            "run one image everywhere (job.image), or the same versions in each",
                        )
                    )
    return out


def _mtu_checks(per_host: dict[str, dict]) -> list[Check]:
    """Each host's MTU, a failure on every host when they differ."""
    out: list[Check] = []
    mtus = {n: f["mtu"] for n, f in per_host.items() if f.get("mtu")}
    for n, f in per_host.items():
        if "mtu" not in f:
            continue
        if len(set(mtus.values())) > 1:
            out.append(
                Check(
                    n,
                    "mtu",
                    FAIL,
                    f"{f['mtu']} (hosts differ: {', '.join(f'{k}={v}' for k, v in mtus.items())})",
                    "set the same MTU on every host's interface (ip link set IFACE mtu N)",
                )
            )
        else:
            out.append(Check(n, "mtu", OK, str(f["mtu"])))
    return out


def _code_checks(per_host: dict[str, dict], local_code: str | None) -> list[Check]:
    """Each host's synced code tree against this machine's (`local_code`; None: not compared)."""
    out: list[Check] = []
    for n, f in per_host.items():
        code = f.get("code")
        if code is None:
            out.append(Check(n, "code", WARN, "no code synced yet", "fab sync"))
        elif local_code is not None and code != local_code:
            out.append(
                Check(
                    n,
                    "code",
                    WARN,
                    f"tree {code[:12]} differs from this machine's {local_code[:12]}",
                    "fab sync (fab train syncs first)",
                )
            )
        else:
            out.append(Check(n, "code", OK, f"tree {code[:12]}"))
    return out
