#!/usr/bin/env bash
# The weight codec's GPU check, one script, at most 5.5 minutes on one H100 or H200 (issue 17). Run from
# the project root on the GPU machine, after the line ../shared/gpu/wheels.sh printed (it installs
# the wheels and sets PYTHONPATH), with OUT set to a folder for the results:
#
#   <wheels line> && OUT=out/gpu bash bench/gpu_codec.sh
#
# 1. bench/weights on a 0.55B-parameter Llama (hidden 1280, 24 layers, vocab 32000; random init,
#    built from a config, trained with Adam on the CPU), one RL-sized step at lr 1.8e-6 (~2% of the
#    bf16 elements change): the delta encoded with the torch path on the GPU, states already there
#    (encode_device_gbps), against the numba kernels on the CPU (encode_gbps) in the same run, and
#    whether both give the same bytes (device_identical). The issue asks >= 50 GB/s for encode and
#    apply; apply has no GPU path yet, so its figure here is the CPU's (decode_gbps).
# 2. The codec's device tests (tests/unit/test_codec_device.py), whose cuda cases run only there:
#    the torch path on cuda against the numba kernels and a numpy reading of the format.
# 3. A plain control of what the card allows: two 1.1 GB bf16 tensors compared element by element
#    (mask, count and nonzero), GB/s of one tensor's bytes.
# Each part has its own time limit, so one that hangs or fails leaves the others' results.
# DEVICE=cpu SIZE="--hidden 128 --layers 2 --vocab 2048" CONTROL_N=1000000 runs the same plumbing
# on a machine without a GPU (the script's own check; its figures mean nothing).
set -uo pipefail
# shellcheck source=bench/gpu_parts.sh
source "$(dirname "$0")/gpu_parts.sh"  # $out, $py, part
export DEVICE=${DEVICE:-cuda} CONTROL_N=${CONTROL_N:-550000000}
size=${SIZE:---hidden 1280 --layers 24 --vocab 32000}

part control 30 "$py" - <<'EOF'
import json, os, time, torch
n, device = int(os.environ["CONTROL_N"]), os.environ["DEVICE"]
a = (torch.randn(n, device=device) * 0.02).bfloat16()
b = a.clone()
b[torch.randint(0, n, (n // 50,), device=device)] += 1e-4
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
sync()
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    mask = a.view(torch.int16) != b.view(torch.int16)
    count = int(mask.sum())
    where = mask.nonzero()
    sync()
    best = min(best, time.perf_counter() - t0)
card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
row = {"card": card, "bytes": n * 2, "changed": count, "compare_gbps": n * 2 / best / 1e9}
print(json.dumps(row))
open(os.path.join(os.environ["OUT"], "control.json"), "w").write(json.dumps(row, indent=2))
EOF
# shellcheck disable=SC2086  # $size is a list of flags
part weights 240 "$py" -m bench.weights --device "$DEVICE" $size --lrs 1.8e-6 --gaps 1 --repeats 2 \
  --json "$out/weights.json"
part tests 45 "$py" -m pytest -q -p no:cacheprovider tests/unit/test_codec_device.py
echo "done: $(tr '\n' ';' < "$out/summary.txt")"
