#!/usr/bin/env bash
# GPU check of the interceptor on a real NVIDIA GPU (H200 class).
#
# Needs: Python 3 with torch (CUDA build), a C compiler (cc), the NVIDIA driver. No network, no
# virtualenv, no project install: the interceptor is compiled here from interceptor/*.c and the
# models are defined below with random weights (no torchvision, no downloads).
#
# Runs ResNet-50 (batch 64, 224x224) and a BERT-base-sized encoder (12 layers, d=768, batch 32 x
# 128 tokens), each eagerly and as a CUDA graph, without the interceptor and under it at quotas
# 1.0, 0.5 and 0.25 (width 1: no MPS). The quota reaches the interceptor as DILU_REQUEST_QUOTA
# (the fail-safe path: no control block, no agent). Prints throughput against quota and the
# overhead at quota 1.0 against no interceptor.
#
# Usage: scripts/gpu_check.sh [SECONDS_PER_RUN (default 8)]   (about 16 runs)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_PER_RUN="${1:-8}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/dilu-gpu-check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))'

echo "== build"
cc -O2 -g -Wall -fPIC -std=gnu11 -I"$HERE/interceptor" -shared \
   -o "$WORK/libdilu_intercept.so" "$HERE/interceptor/interceptor.c" -ldl -lpthread -lm
echo "built $WORK/libdilu_intercept.so"

cat > "$WORK/run_model.py" <<'PY'
"""One throughput measurement: python run_model.py MODEL MODE SECONDS -> one JSON line."""
import json
import sys
import time

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        return torch.relu(self.body(x) + idt)


def resnet50():
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30522, 768)
        layer = nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)

    def forward(self, ids):
        return self.enc(self.emb(ids))


def main():
    model_name, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    if model_name == "resnet50":
        model, x, per_iter = resnet50(), torch.randn(64, 3, 224, 224, device=dev), 64
    else:
        model, x, per_iter = Bert(), torch.randint(0, 30522, (32, 128), device=dev), 32
    model = model.to(dev).eval().to(torch.bfloat16 if model_name == "resnet50" else torch.float32)
    if model_name == "resnet50":
        x = x.to(torch.bfloat16)
    ctx = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)  # graph-capturable
           if model_name == "bert" else torch.no_grad())
    with torch.inference_mode(), ctx:
        for _ in range(5):
            model(x)
        torch.cuda.synchronize()
        step = lambda: model(x)
        if mode == "graph":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    model(x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model(x)
            step = g.replay
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            iters += 5
        dt = time.perf_counter() - t0
    print(json.dumps({"model": model_name, "mode": mode, "items_per_s": iters * per_iter / dt,
                      "iters": iters, "seconds": dt}))


main()
PY

run() { # quota (or none) model mode; a failed run is reported and skipped
    local quota="$1" model="$2" mode="$3" out
    if [ "$quota" = none ]; then
        out=$(env -u LD_PRELOAD "$PY" "$WORK/run_model.py" "$model" "$mode" "$SECONDS_PER_RUN") ||
            { echo "  quota=$quota FAILED"; return 0; }
    else
        out=$(LD_PRELOAD="$WORK/libdilu_intercept.so" DILU_REQUEST_QUOTA="$quota" DILU_WIDTH=1 \
              DILU_INTERCEPT_DEBUG="${DILU_INTERCEPT_DEBUG:-}" \
              "$PY" "$WORK/run_model.py" "$model" "$mode" "$SECONDS_PER_RUN") ||
            { echo "  quota=$quota FAILED"; return 0; }
    fi
    echo "$quota $(echo "$out" | tail -n 1)" >> "$WORK/results.txt"
    echo "  quota=$quota $out"
}

echo "== interceptor start-up (debug lines of one run)"
LD_PRELOAD="$WORK/libdilu_intercept.so" DILU_REQUEST_QUOTA=1.0 DILU_INTERCEPT_DEBUG=1 \
    "$PY" -c 'import torch; a = torch.ones(1024, device="cuda"); torch.cuda.synchronize(); print("ok", float((a * 2).sum()))' 2>&1 | tail -n 20

echo "== runs (${SECONDS_PER_RUN}s each)"
: > "$WORK/results.txt"
for model in resnet50 bert; do
    for mode in eager graph; do
        echo "$model $mode"
        for quota in none 1.0 0.5 0.25; do
            run "$quota" "$model" "$mode"
        done
    done
done

echo "== throughput against quota"
"$PY" - "$WORK/results.txt" <<'PY'
import json, sys
rows = []
for line in open(sys.argv[1]):
    quota, blob = line.split(" ", 1)
    r = json.loads(blob)
    rows.append((r["model"], r["mode"], quota, r["items_per_s"]))
base = {(m, mo): v for m, mo, q, v in rows if q == "none"}
print(f"{'model':10} {'mode':6} {'quota':>6} {'items/s':>10} {'vs none':>8} {'expected':>8}")
for m, mo, q, v in rows:
    rel = f"{v / base[(m, mo)]:8.3f}" if (m, mo) in base else "       -"
    exp = "1.00" if q == "none" else f"{float(q):.2f}"
    print(f"{m:10} {mo:6} {q:>6} {v:10.1f} {rel} {exp:>8}")
print()
for (m, mo), b in base.items():
    full = [v for mm, mmo, q, v in rows if (mm, mmo, q) == (m, mo, "1.0")]
    if full:
        print(f"overhead at quota 1.0, {m} {mo}: {100 * (1 - full[0] / b):+.2f} % throughput")
PY
