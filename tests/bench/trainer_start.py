"""Benchmark: what a rank pays at its start in a new container of the trainer image, with the
bytecode the image carries now against the image as it was before torch._dynamo's was written.

    .venv/bin/python tests/bench/trainer_start.py --repeat 5

"before" is made here from fabtrain/trainer:latest: every .pyc of its packages deleted, then the
old image's import line run again (what the image wrote until torch._dynamo and the rest were
added to it), so the two differ in their bytecode only. Each round runs, in a new container of
each image (alternating), as a user who cannot write bytecode there (as a rank started with
--user does): `import torch`, then one torch.optim.AdamW made (it imports torch._dynamo), then
torch.distributed's gloo group of one and a DDP model (what DDP and the group import). Prints
medians (seconds) and each round's numbers. Only the local Docker engine is used; nothing is sent
anywhere. The "before" image is removed after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.testbed import cluster  # noqa: E402

IMAGE = "fabtrain/trainer:latest"
BEFORE = "fabtrain/bench-trainer-before:latest"
SITE = "/usr/local/lib/python3.11/dist-packages"
# The import line of docker/trainer.Dockerfile before torch._dynamo's bytecode was written there.
OLD_IMPORTS = (
    "import torch, torch.distributed.run, torch.nn.parallel, torch.utils.data, "
    "torch.utils.tensorboard, numpy, hydra, yaml"
)
PROBE = """\
import json, os, time
t0 = time.monotonic()
import torch
t1 = time.monotonic()
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
t2 = time.monotonic()
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
dist.init_process_group("gloo", rank=0, world_size=1)
ddp = DDP(model)
ddp(torch.zeros(2, 8)).sum().backward()
opt.step()
dist.destroy_process_group()
t3 = time.monotonic()
print(json.dumps({"torch": t1 - t0, "optimizer": t2 - t1, "ddp": t3 - t2, "total": t3 - t0}))
"""


def build_before() -> None:
    cluster.build_from_text(
        BEFORE, f"FROM {IMAGE}\nRUN find {SITE} -name '*.pyc' -delete && python3 -c '{OLD_IMPORTS}'\n"
    )


def probe(image: str) -> dict[str, float]:
    r = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "--user",
            "1000:1000",
            "--entrypoint",
            "python3",
            image,
            "-c",
            PROBE,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    build_before()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    try:
        for _ in range(args.repeat):
            for name, image in (("before", BEFORE), ("now", IMAGE)):
                runs[name].append(probe(image))
    finally:
        subprocess.run(["docker", "rmi", "-f", BEFORE], capture_output=True)
    keys = ("torch", "optimizer", "ddp", "total")
    print(f"{args.repeat} rounds, medians in seconds (one rank in a new container, --user 1000)")
    print("| image | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, got in runs.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[k] for r in got):.2f}" for k in keys) + " |")
    print("raw: " + json.dumps(runs))


if __name__ == "__main__":
    sys.exit(main())
