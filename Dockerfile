# ShardFlow worker/producer image (GPU-capable: the PyTorch base ships CUDA).
FROM pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md ./
COPY producer producer
COPY workers workers
COPY relay_broker relay_broker
COPY schemas schemas
RUN pip install --no-cache-dir . && useradd --create-home shardflow
USER shardflow
ENTRYPOINT ["shardflow"]
