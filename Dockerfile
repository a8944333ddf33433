# kvatlas: one image for the indexer, workers and router (see compose.yaml).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
# libibverbs1 librdmacm1 libnuma1: what the Mooncake Store client and master link (the mooncake extra)
RUN apt-get update && apt-get install -y --no-install-recommends build-essential \
    libibverbs1 librdmacm1 libnuma1 && rm -rf /var/lib/apt/lists/*
# CPU torch first, from PyTorch's CPU index, so the producer extra never pulls a CUDA build.
RUN pip install torch --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md ./
COPY schemas ./schemas
COPY cbuild ./cbuild
COPY transport ./transport
COPY producer ./producer
COPY indexer ./indexer
COPY router_api ./router_api
COPY sim ./sim
COPY cli ./cli
COPY tests/data/traces ./tests/data/traces
RUN pip install -e '.[producer,yaml,mooncake]'
EXPOSE 8700 8100 8800 5557 5558
CMD ["kvatlas", "--help"]
