#!/usr/bin/env bash
# TensorBoard as a user first sees it, checked in a real headless browser.
#
#   bash benchmarks/tensorboard_screenshot.sh [OUT.png]      (default: benchmarks/tensorboard.png)
#
# Trains a short run of the tiny config with evaluations into a temporary folder, serves it with
# `tensorboard`, loads the Time Series page in headless Chromium, and checks what the page shows
# first: the scalar groups in page order must start with `loss` (the train and eval loss). Then
# saves a screenshot of that first view (the README shows benchmarks/tensorboard.png).
# Needs Chromium's headless shell (Debian/Ubuntu: apt-get install chromium-headless-shell) and
# the package installed (`pip install -e .`). Takes about a minute on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/tensorboard.png}
chrome=$(command -v chromium-headless-shell || command -v chromium || command -v google-chrome || true)
[ -n "$chrome" ] || { echo "tensorboard_screenshot: no Chromium found (apt-get install chromium-headless-shell)" >&2; exit 2; }
work=$(mktemp -d)
tb_pid=
cleanup() { [ -n "$tb_pid" ] && kill "$tb_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

loomtrain train configs/tiny.yaml run.dir="$work/runs/tiny" train.max_steps=60 eval.every_steps=20 \
    log.progress=plain >"$work/train.log" 2>&1 || { tail -20 "$work/train.log" >&2; exit 1; }

port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
tensorboard --logdir "$work/runs" --host 127.0.0.1 --port "$port" >"$work/tensorboard.log" 2>&1 &
tb_pid=$!
for _ in $(seq 60); do
    curl -sf "http://127.0.0.1:$port/data/runs" | grep -q tiny && break
    sleep 1
done
# forceSVG: TensorBoard draws its charts with WebGL in a worker, which a headless browser without a
# GPU leaves blank; its SVG renderer draws the same charts.
url="http://127.0.0.1:$port/?forceSVG=true#timeseries"
browse=("$chrome" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1400
        --virtual-time-budget=20000)

# The groups in the order the page lays them out (each group's header names it).
"${browse[@]}" --dump-dom "$url" 2>/dev/null >"$work/page.html"
groups=$(python - "$work/page.html" <<'EOF'
import re, sys
html = open(sys.argv[1]).read()
tags = [t for t in re.findall(r"<span[^>]*>", html) if 'class="group-title"' in t]  # a group's heading
names = [re.search(r'title="([^"]*)"', t).group(1) for t in tags if 'title="' in t]
print(" ".join(dict.fromkeys(names)))
EOF
)
echo "groups, in page order: ${groups:-(none found)}"
[ "${groups%% *}" = "loss" ] || { echo "tensorboard_screenshot: the first group is not 'loss'" >&2; exit 1; }

"${browse[@]}" --screenshot="$PWD/$out" "$url" 2>/dev/null
echo "screenshot: $out"
