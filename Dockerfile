# One image for every flywheel role; the command picks the role (`flywheel gateway`, ...).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY flywheel ./flywheel
COPY serving ./serving
COPY ingest ./ingest
COPY rewards ./rewards
COPY trainer ./trainer
COPY launch ./launch
COPY demo ./demo
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
ENTRYPOINT ["flywheel"]
