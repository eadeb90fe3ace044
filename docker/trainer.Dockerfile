ARG BASE=fabtrain/base:bookworm
FROM ${BASE}
COPY site /usr/local/lib/python3.11/dist-packages
# The bytecode of what a training process imports, written once here: pip installed the packages
# without it (--no-compile), and otherwise every new container compiles torch again (about 4 s of
# CPU each) or, run as a user who cannot write there, every process does.
RUN python3 -c "import torch, torch.distributed.run, torch.nn.parallel, torch.utils.data, \
    torch.utils.tensorboard, numpy, hydra, yaml"
COPY entrypoint.py /usr/local/bin/fabtrain-entrypoint
ENV PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PATH=/usr/local/lib/python3.11/dist-packages/bin:$PATH
WORKDIR /workspace
ENTRYPOINT ["python3", "/usr/local/bin/fabtrain-entrypoint"]
