# The project image: used by the Prefect worker, the Ray nodes and the MLflow server.
FROM python:3.11.11-slim-bookworm
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY crawl2chat crawl2chat
COPY flows flows
COPY tasks tasks
COPY stages stages
COPY infra infra
COPY prefect.yaml* ./
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
 && pip install ".[s3]" psycopg2-binary boto3
# Containers run as an ordinary user: it writes the project's home (.crawl2chat/) and
# runs/ (whose volume starts out owned by it), never the code.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin crawl2chat \
 && mkdir -p /app/runs /app/.crawl2chat \
 && chown crawl2chat:crawl2chat /app/runs /app/.crawl2chat
USER 1000:1000
