#!/usr/bin/env bash
# Screenshots of the Prefect and MLflow UIs after a small run, for the README (docs/images/).
#
# Starts a Prefect server and an MLflow tracking server on 127.0.0.1 (state in a
# temporary folder), creates the process work pool, runs `prefect deploy --all` from
# prefect.yaml, starts a worker, and runs the `data-refresh` deployment (a crawl of
# 40 pages of the embedded documentation site) and then the `pretrain` deployment (a
# tiny model, 30 steps) on its dataset, both through the REST call of the UI's "Run"
# form. Then headless Chromium (driven by scripts/ui_screenshot.py) takes the Prefect
# deployments page, the data-refresh flow run's page and the MLflow page of the
# pretraining run (metrics, the dataset version it read and the tags linking it to
# the run that wrote that version), and Pillow keeps each PNG under 300 KB.
#
# Needs Debian's `chromium`; when it is missing the script installs it with apt-get,
# which needs root (or sudo) and the Debian package registry. Not run by CI.
#
#   scripts/ui_snapshots.sh                  # writes docs/images/*.png
#   OUT_DIR=/tmp/shots scripts/ui_snapshots.sh
# Environment: PYTHON (default .venv/bin/python), OUT_DIR (default docs/images),
# KEEP_WORK=1 keeps the temporary folder (servers' logs, the run folders).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT_DIR=${OUT_DIR:-$ROOT/docs/images}
WORK=$(mktemp -d -t crawl2chat-ui.XXXXXX)
mkdir -p "$OUT_DIR" "$WORK/logs" "$WORK/prefect-home"

if ! command -v chromium >/dev/null 2>&1; then
    echo "chromium is missing: installing Debian's package with apt-get (needs root and the apt registry)"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium
fi

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Each service runs in a session of its own; its pid (= its process group) goes to WORK/NAME.pid.
start() {
    local name=$1; shift
    setsid bash -c 'echo $$ > "$0"; exec "$@"' "$WORK/$name.pid" "$@" > "$WORK/logs/$name.log" 2>&1 &
}

stop_all() {
    local name pid
    for name in worker mlflow prefect; do
        [ -f "$WORK/$name.pid" ] || continue
        pid=$(cat "$WORK/$name.pid")
        kill -TERM -- "-$pid" 2>/dev/null || true
        for _ in $(seq 20); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    if [ "${KEEP_WORK:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap stop_all EXIT

wait_http() {
    for _ in $(seq 240); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 1
    done
    echo "$1 did not answer; logs in $WORK/logs" >&2
    KEEP_WORK=1
    return 1
}

PREFECT_PORT=$(free_port)
MLFLOW_PORT=$(free_port)
export PREFECT_HOME=$WORK/prefect-home PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
    MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS
# The daily schedule shows on the deployments page; no run is started from it here.
# The UI is told where its API is (it assumes port 4200 otherwise).
PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED=false PREFECT_SERVER_UI_API_URL=http://127.0.0.1:$PREFECT_PORT/api \
    start prefect "$PY" -m prefect server start \
    --host 127.0.0.1 --port "$PREFECT_PORT"
start mlflow "$PY" -m mlflow server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "sqlite:///$WORK/mlflow.db" --serve-artifacts --artifacts-destination "$WORK/artifacts"
export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT
export CRAWL2CHAT_WORKDIR=$ROOT
wait_http "$PREFECT_API_URL/health"
wait_http "$MLFLOW_TRACKING_URI/health"
echo "Prefect UI http://127.0.0.1:$PREFECT_PORT  MLflow UI $MLFLOW_TRACKING_URI"

"$PY" -m prefect work-pool create crawl2chat --type process >/dev/null
start worker "$PY" -m prefect worker start --pool crawl2chat
"$PY" -m prefect --no-prompt deploy --all >"$WORK/logs/deploy.log"

# The runs, started as the UI's form starts them: schema defaults, the deployment's
# parameters, then only the sizes and folders changed.
"$PY" - "$WORK" > "$WORK/ids.env" <<'PY'
import copy, json, sys, time, urllib.request
import os

api, work = os.environ["PREFECT_API_URL"], sys.argv[1]


def call(method, path, body=None):
    req = urllib.request.Request(api + path, method=method, headers={"Content-Type": "application/json"},
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def form(deployment, changes):
    schema = deployment["parameter_openapi_schema"]["properties"]
    values = {k: copy.deepcopy(deployment["parameters"].get(k, p.get("default"))) for k, p in schema.items()}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = values
        for key in parents:
            node = node[key]
        assert leaf in node, dotted
        node[leaf] = value
    return values


def run(name, changes):
    deployment = call("GET", f"/deployments/name/{name}")
    flow_run = call("POST", f"/deployments/{deployment['id']}/create_flow_run",
                    {"parameters": form(deployment, changes)})
    while flow_run["state_type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        time.sleep(3)
        flow_run = call("GET", f"/flow_runs/{flow_run['id']}")
    print(f"{name}: {flow_run['state_type']}", file=sys.stderr)
    if flow_run["state_type"] != "COMPLETED":
        sys.exit(f"{name} ended {flow_run['state_type']}: {flow_run['state']['message']}")
    return flow_run


common = {"config.home": f"{work}/home"}
data = run("data/data-refresh", {**common, "config.data.out": f"{work}/data", "config.data.crawl.max_pages": 40})
tiny = {"preset": "tiny", "vocab_size": 512, "seq_len": 64, "micro_batch_size": 8, "max_steps": 30,
        "warmup_steps": 3, "eval_every": 10, "eval_batches": 4, "checkpoint_every": 10, "val_fraction": 0.2,
        "log_every": 1}
run("pretrain/pretrain", {**common, "data": f"{work}/data", "config.pretrain.out": f"{work}/pretrain",
                          **{f"config.pretrain.train.{k}": v for k, v in tiny.items()}})

import mlflow  # noqa: E402

client = mlflow.MlflowClient()
experiment = client.get_experiment_by_name("crawl2chat")
[stage] = client.search_runs([experiment.experiment_id], "tags.`crawl2chat.stage` = 'pretrain'")
print(f"DATA_RUN={data['id']}")
print(f"EXPERIMENT={experiment.experiment_id}")
print(f"PRETRAIN_RUN={stage.info.run_id}")
PY
# shellcheck disable=SC1091
. "$WORK/ids.env"

# Single-page UIs: each page gets 12 s to fetch its data. MLflow opens in its model-training
# view, with its assistant side panel closed.
"$PY" scripts/ui_screenshot.py --wait 12 \
    "$OUT_DIR/prefect-deployments.png" "http://127.0.0.1:$PREFECT_PORT/deployments" \
    "$OUT_DIR/prefect-flow-run.png" "http://127.0.0.1:$PREFECT_PORT/runs/flow-run/$DATA_RUN"
"$PY" scripts/ui_screenshot.py --wait 12 --height 1250 \
    "$OUT_DIR/mlflow-run.png" "$MLFLOW_TRACKING_URI/#/experiments/$EXPERIMENT/runs/$PRETRAIN_RUN?workflowType=machine_learning" \
    --before 'document.querySelector("[data-component-id=\"mlflow.assistant.chat_panel.close\"]")?.click()'

# Each PNG under 300 KB: as taken when it fits, else 256 colours, then smaller, as needed.
"$PY" - "$OUT_DIR"/prefect-deployments.png "$OUT_DIR"/prefect-flow-run.png "$OUT_DIR"/mlflow-run.png <<'PY'
import os, sys
from PIL import Image

LIMIT = 300 * 1024
for path in sys.argv[1:]:
    image = Image.open(path).convert("RGB")
    image.save(path, optimize=True)
    size, scale = image.size, 1.0
    while os.path.getsize(path) > LIMIT and scale > 0.5:
        size = (round(image.width * scale), round(image.height * scale))
        small = image.resize(size, Image.LANCZOS) if scale < 1 else image
        small.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        scale *= 0.85
    print(f"{path}: {size[0]}x{size[1]}, {os.path.getsize(path) // 1024} KB")
PY
