ARG BASE=fabtrain/base:bookworm
FROM ${BASE}
COPY site /usr/local/lib/python3.11/dist-packages
COPY entrypoint.py /usr/local/bin/fabtrain-entrypoint
ENV PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PATH=/usr/local/lib/python3.11/dist-packages/bin:$PATH
WORKDIR /workspace
ENTRYPOINT ["python3", "/usr/local/bin/fabtrain-entrypoint"]
