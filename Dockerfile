# ShardFlow worker/producer image (GPU-capable: the PyTorch base ships CUDA).
FROM pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md ./
COPY producer producer
COPY workers workers
COPY relay_broker relay_broker
COPY schemas schemas
# The model cache exists, owned by shardflow, before compose mounts its hf-cache volume there: Docker
# fills a new named volume from the image's directory, ownership included (else root-owned, unwritable).
RUN pip install --no-cache-dir . && useradd --create-home shardflow \
    && install -d -o shardflow -g shardflow /home/shardflow/.cache /home/shardflow/.cache/huggingface
ENV HF_HOME=/home/shardflow/.cache/huggingface
USER shardflow
ENTRYPOINT ["shardflow"]
