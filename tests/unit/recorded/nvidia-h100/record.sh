#!/usr/bin/env bash
# The commands whose outputs are recorded in this folder. Run from the repository root on a GPU
# machine: bash tests/unit/recorded/nvidia-h100/record.sh OUTDIR
# Each command's output goes into a section "===== COMMAND =====" ending with its exit status.
set -u
OUTDIR=${1:?usage: record.sh OUTDIR}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/fabtrain-recorded}
rm -rf "$WORK" && mkdir -p "$WORK"

# sec LIMIT_S COMMAND...: one section, the command bounded by LIMIT_S seconds.
sec() {
    local limit=$1; shift
    echo "===== $* ====="
    local t0=$SECONDS
    timeout -k 5 "$limit" bash -c "$*" 2>&1
    echo "----- exit status $? ($((SECONDS - t0)) s) -----"
    echo
}

Q='index,name,uuid,pci.bus_id,memory.total,ecc.errors.uncorrected.volatile.total,clocks_throttle_reasons.active,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max'
{
    sec 60 "nvidia-smi -q"
    sec 60 "nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE,CLOCK,TEMPERATURE,POWER"
    sec 30 "nvidia-smi --query-gpu=$Q --format=csv"
    sec 30 "nvidia-smi --query-gpu=${Q/clocks_throttle_reasons/clocks_event_reasons} --format=csv"
    sec 30 "nvidia-smi --query-gpu=name --format=csv,noheader"
    sec 30 "nvidia-smi -L"
    sec 30 "nvidia-smi topo -m"
    sec 30 "nvidia-smi"
} >"$OUTDIR/nvidia-smi.txt"

{
    sec 150 "which dcgmi && timeout 120 dcgmi diag -r 1"
    sec 30 "dmesg 2>&1 | grep -i xid | tail"
    sec 30 "dmesg >/dev/null 2>&1; echo dmesg exit status \$?"
    sec 30 "docker info 2>&1 | head -40"
    sec 30 "ls /etc/cdi /var/run/cdi 2>&1"
    sec 30 "ls -l /dev/nvidia*"
    sec 30 "ibv_devinfo 2>&1 | head"
    sec 30 "ls /sys/class/infiniband 2>&1"
    sec 60 "python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))'"
    sec 60 "python3 -c 'import torch; print(\"nccl\", torch.cuda.nccl.version(), \"capability\", torch.cuda.get_device_capability(0), \"devices\", torch.cuda.device_count())'"
    sec 30 "which python3 torchrun nvcc; python3 --version; nvcc --version | tail -2"
    sec 30 "python3 -m pip list 2>/dev/null | grep -iE '^(torch|triton|numpy|pytest|pyyaml|nvidia-nccl)'"
    sec 30 "nproc; free -g; df -h /"
    sec 30 "uname -r; head -4 /etc/os-release"
    # The preflight's own probes (orchestrator/hostcmds/dockerargs.py gpu_probe_argv, orchestrator/preflight/
    # IMAGE_INFO_PY, run here with the host's python3 rather than in a container).
    sec 30 "echo runtimes \$(timeout -k 2 8 docker info --format '{{json .Runtimes}}' 2>/dev/null); echo cdi \$(cat /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json 2>/dev/null | grep -c 'nvidia.com/gpu')"
    sec 60 "python3 -c \"import ast; m = ast.parse(open('orchestrator/preflight.py').read()); exec(next(n.value.value for n in m.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'IMAGE_INFO_PY'))\""
} >"$OUTDIR/host.txt"

# bf16 autocast as gpt.py sets it up, checked on the tiny GPU preset.
BF16_PY='
import sys, torch
sys.path.insert(0, "trainers")
import gpt
d = torch.device("cuda", 0)
print("device", torch.cuda.get_device_name(d), "capability", torch.cuda.get_device_capability(d), "use_bf16", gpt.use_bf16(d))
mc, tc = gpt.PRESETS["tiny"]
import dataclasses
m = gpt.GPT(dataclasses.replace(mc, vocab_size=65)).to(d)
x = torch.randint(0, 65, (2, mc.block_size), device=d)
with torch.autocast("cuda", dtype=torch.bfloat16):
    logits, loss = m(x, x)
print("params", sum(p.numel() for p in m.parameters()), "param dtype", next(m.parameters()).dtype, "logits dtype under autocast", logits.dtype, "loss dtype", loss.dtype)
print("peak_flops", gpt.peak_flops(torch.cuda.get_device_name(d)))
'
{
    sec 60 "python3 -c '$BF16_PY'"
    sec 240 "FABTRAIN_OUTPUT=$WORK/gpt-tiny torchrun --standalone --nproc_per_node 1 trainers/gpt.py --model tiny --epochs 1"
    sec 10 "cat $WORK/gpt-tiny/metrics.jsonl; ls -l $WORK/gpt-tiny/snapshots"
    sec 240 "FABTRAIN_OUTPUT=$WORK/gpt-tiny3 torchrun --standalone --nproc_per_node 1 trainers/gpt.py --model tiny --epochs 3 --sample-chars 0"
} >"$OUTDIR/gpt-tiny.log"

# small for 300 steps: the generated corpus (200,000 characters) gives 5 steps per epoch at the
# GPU preset's batch (8 x 16 x 256 tokens), so a longer generated text is used here.
{
    sec 60 "python3 -c \"import sys; sys.path.insert(0, 'trainers'); import corpus; open('$WORK/corpus-10M.txt', 'w').write(corpus.generate(10_000_000))\"; wc -c $WORK/corpus-10M.txt"
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,clocks.sm,temperature.gpu --format=csv -l 5 >"$WORK/smi-during-small.csv" 2>&1 &
    SMI=$!
    sec 300 "torchrun --standalone --nproc_per_node 1 trainers/gpt.py --model small --data $WORK/corpus-10M.txt --epochs 1 --max-steps-per-epoch 300 --log-every 25 --snapshot-every 0 --out $WORK/gpt-small"
    kill "$SMI" 2>/dev/null
    sec 10 "cat $WORK/smi-during-small.csv"
} >"$OUTDIR/gpt-small.log"

{
    sec 120 "torchrun --standalone --nproc_per_node 1 trainers/mlp_tp.py --tp 1 --steps 50"
    sec 120 "python3 trainers/mlp_tp.py --tp 1 --steps 20"
    sec 120 "NCCL_DEBUG=INFO torchrun --standalone --nproc_per_node 1 trainers/smoke.py"
    sec 120 "FABTRAIN_SMOKE_MB=256 FABTRAIN_SMOKE_ITERS=20 torchrun --standalone --nproc_per_node 1 trainers/smoke.py"
    sec 120 "torchrun --standalone --nproc_per_node 1 trainers/mlp_tp.py --tp 2 --steps 5"
} >"$OUTDIR/distributed.log"

{
    sec 200 "python3 -m pytest tests/trainers -q -p no:cacheprovider -rfE --durations=8"
} >"$OUTDIR/pytest-trainers-gpu.log"
{
    sec 200 "CUDA_VISIBLE_DEVICES= python3 -m pytest tests/trainers -q -p no:cacheprovider -rfE --durations=8"
} >"$OUTDIR/pytest-trainers-cpu.log"
