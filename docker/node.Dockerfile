# A training machine for trainguard: sshd (key-only) for the control plane, the tg-node agent, torch.
# Its entrypoint is `tg-node up`, the same command `trainguard cluster up` runs for every emulated
# machine: it writes the node configuration from TG_MACHINE / TG_BUS_URL / ... when none is mounted,
# makes the host key once (kept in the config volume), writes sshd_config, starts sshd and the agent,
# and stays in the foreground until the container is stopped.
#
#   docker build -f docker/node.Dockerfile -t trainguard-node .
#   (GPU machines: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 and run with --gpus all)
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-server openssh-client iproute2 procps \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd /etc/trainguard /var/lib/trainguard

WORKDIR /opt/trainguard
COPY constraints.txt pyproject.toml setup.py README.md ./
# torch from its own index (the CPU or a CUDA build), first: the rest then finds it installed
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==2.13.0"
COPY trainguard ./trainguard
COPY node_tools ./node_tools
COPY checkpoint ./checkpoint
COPY operators ./operators
COPY examples ./examples
# the node's side (trainguard[node]): the agent, tg-node, the checkpoint library and the training faces; no Airflow,
# no Celery, no test tools. A team's trainer (Lightning, Transformers) goes into the image built FROM this one.
RUN pip install --no-cache-dir ".[node]" -c constraints.txt

ENV TG_NODE_CONFIG=/etc/trainguard/node.json \
    TG_WORKDIR=/var/lib/trainguard \
    TG_NVML_BACKEND=auto
VOLUME ["/etc/trainguard", "/var/lib/trainguard"]
EXPOSE 22
STOPSIGNAL SIGTERM
ENTRYPOINT ["tg-node", "up", "--config", "/etc/trainguard/node.json", "--sshd", "/usr/sbin/sshd", \
            "--authorized-keys", "/etc/trainguard/keys/authorized_keys", "--foreground"]
