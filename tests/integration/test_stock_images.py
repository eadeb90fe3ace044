"""Images as users have them: a stock image whose own ENTRYPOINT execs its arguments (as NGC's
does) and which holds no fabtrain entrypoint, a module installed only in the image, and an image
without torch. The images are built on this machine from the trainer image (the hosts hold the
same image id) and sent with `fab image.push`, which sends only the layers the hosts lack."""

import json
import subprocess

import pytest

from orchestrator.testbed import cluster

from .conftest import fab, on_host

STOCK = "fabtrain-test/stock:1"
NO_TORCH = "fabtrain-test/no-torch:1"
SITE = "/usr/local/lib/python3.11/dist-packages"
# A vendor entrypoint like NGC's: prints a banner, then execs whatever it is given.
VENDOR_ENTRYPOINT = '#!/bin/sh\\necho VENDOR-BANNER\\nexec "$@"\\n'
MODULE = (
    "import json, os, torch, torch.distributed as dist\\n"
    "dist.init_process_group('gloo')\\n"
    "t = torch.tensor([1.0]); dist.all_reduce(t)\\n"
    # One write per line (chr(10): no escapes to survive printf), so ranks' lines never interleave.
    "os.write(1, ('MODULE ' + json.dumps({'rank': dist.get_rank(), 'world': dist.get_world_size(),"
    " 'sum': t.item(), 'file': __file__}) + chr(10)).encode())\\n"
    "dist.barrier(); dist.destroy_process_group()\\n"
)


def push(inventory_path, *tags: str) -> None:
    for tag in tags:
        r = fab(inventory_path, "image.push", "--image", tag, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


@pytest.fixture(scope="module")
def stock_images(inventory_path):
    # Built here, once: the same image id on both hosts (a build on each would differ, which
    # preflight refuses).
    cluster.build_from_text(
        STOCK,
        "FROM fabtrain/trainer:latest\n"
        "RUN rm -f /usr/local/bin/fabtrain-entrypoint\n"
        f"RUN printf '{VENDOR_ENTRYPOINT}' > /usr/local/bin/vendor-entrypoint && "
        "chmod +x /usr/local/bin/vendor-entrypoint\n"
        f'RUN printf "{MODULE}" > {SITE}/fabmod_probe.py\n'
        'ENTRYPOINT ["/usr/local/bin/vendor-entrypoint"]\n',
    )
    cluster.build_from_text(NO_TORCH, f"FROM fabtrain/trainer:latest\nRUN rm -rf {SITE}/torch\n")
    push(inventory_path, STOCK, NO_TORCH)
    yield
    for node in ("node1", "node2"):
        on_host(node, f"docker rmi -f {STOCK} {NO_TORCH}; docker image prune -f", check=False)
    subprocess.run(["docker", "rmi", "-f", STOCK, NO_TORCH], capture_output=True)


def test_stock_image_with_a_foreign_entrypoint_trains_as_is(inventory_path, stock_images):
    # The image really is foreign: its entrypoint wins when it is run plainly.
    plain = on_host("node1", f"docker run --rm {STOCK} echo hi").stdout
    assert plain.split() == ["VENDOR-BANNER", "hi"]
    r = fab(
        inventory_path,
        "train",
        "--image",
        STOCK,
        "--model",
        "tiny",
        "--epochs",
        "1",
        "--nproc",
        "1",
        "--args",
        "--max-steps-per-epoch 3 --log-every 1 --sample-chars 0",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "nodes=2 node_rank=0" in r.stdout and "nodes=2 node_rank=1" in r.stdout  # our entrypoint ran
    assert "VENDOR-BANNER" not in r.stdout
    assert "epoch 0 done | eval loss" in r.stdout


def test_module_installed_only_in_the_image(inventory_path, stock_images):
    r = fab(
        inventory_path,
        "train",
        "--image",
        STOCK,
        "--module",
        "fabmod_probe",
        "--nproc",
        "2",
        "--skip-preflight",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    reports = [
        json.loads(line.split("MODULE ", 1)[1]) for line in r.stdout.splitlines() if "| MODULE " in line
    ]
    assert sorted(rep["rank"] for rep in reports) == [0, 1, 2, 3]
    assert all((rep["world"], rep["sum"]) == (4, 4.0) for rep in reports)
    assert all(rep["file"] == "/usr/local/lib/python3.11/dist-packages/fabmod_probe.py" for rep in reports)
    bad = fab(inventory_path, "train", "--module", "fabmod_probe; id", "--skip-preflight")
    assert bad.returncode == 2 and "is not a Python module name" in bad.stderr


def test_image_without_torch_fails_preflight_naming_it(inventory_path, stock_images):
    r = fab(inventory_path, "train", "--image", NO_TORCH, "--model", "tiny", "--epochs", "1")
    assert r.returncode == 1
    assert "preflight failed on node1, node2; nothing was started" in r.stderr
    assert "but no torch (ModuleNotFoundError" in r.stdout
    assert "fab image.build --base fabtrain-test/no-torch:1" in r.stdout
    ok = fab(inventory_path, "preflight", "--no-smoke", "--json")
    checks = json.loads(ok.stdout)
    image = [c for c in checks["checks"] if c["check"] == "image"]
    assert len(image) == 2 and all(
        c["status"] == "ok" and ": python 3." in c["detail"] and ", torch 2." in c["detail"] for c in image
    ), image
