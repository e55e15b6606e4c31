# kvdepot on vLLM's serving image: one image for the daemon (the entrypoint,
# kvdepotd) and for vLLM engines using kvdepot's connector (run with the
# command python3 -m vllm.entrypoints.openai.api_server, or vllm serve).
# The daemon needs torch with CUDA, which that image has; kvdepot is installed
# without its dependencies so that the image's torch stays the one vLLM was
# built against.
#
#   docker build -t registry.example.com/kvdepot:0.1.0 .
#   docker build --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.33.0 ...
#
# vLLM 0.32 and 0.33 are supported (README, "Using it with vLLM").
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

COPY . /opt/kvdepot-src
# The runtime dependencies of pyproject.toml other than torch (and tomli,
# for Python before 3.11); tests/test_deploy.py keeps this list equal to it.
RUN python3 -m pip install --no-cache-dir --no-deps /opt/kvdepot-src \
    && python3 -m pip install --no-cache-dir \
        "grpcio>=1.84.0" \
        "protobuf>=7.35.1" \
        "grpcio-health-checking>=1.62" \
        "grpcio-reflection>=1.84.0" \
        "prometheus-client>=0.20" \
        "uvloop>=0.19" \
        "xxhash>=3.0" \
    && rm -rf /opt/kvdepot-src \
    && (python3 -m kvdepot.server.native.build --quiet \
        || echo "kvdepot: the native lane did not build; the daemon will run the Python lane") \
    && kvdepotd --help > /dev/null

ENTRYPOINT ["kvdepotd"]
