ARG BASE=fabtrain/base:bookworm
FROM ${BASE}
COPY site /usr/local/lib/python3.11/dist-packages
# The bytecode of what a training process imports, written once here: pip installed the packages
# without it (--no-compile), and otherwise every new container compiles torch again (about 4 s of
# CPU each) or, run as a user who cannot write there, every process does. torch._dynamo (and sympy
# under it) comes with the first torch.optim optimizer a rank makes: compiled at each start, 3-4 s
# of CPU per rank; the rest is what DDP and torchrun's rendezvous import.
RUN python3 -c "import torch, torch.distributed.run, torch.nn.parallel, torch.utils.data, \
    torch.utils.tensorboard, numpy, hydra, yaml, torch.optim, torch._dynamo, torch.profiler, \
    torch.distributed.algorithms.ddp_comm_hooks, torch.utils.serialization, \
    torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"
COPY entrypoint.py /usr/local/bin/fabtrain-entrypoint
# The runtime modules, beside it: where it and fabtrain_memory find theirs.
COPY fabtrain_*.py /usr/local/bin/
ENV PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PATH=/usr/local/lib/python3.11/dist-packages/bin:$PATH
WORKDIR /workspace
ENTRYPOINT ["python3", "/usr/local/bin/fabtrain-entrypoint"]
