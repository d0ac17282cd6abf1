#!/usr/bin/env bash
# The trainer's GPU check, one script, about 4 minutes on one H100 or H200 (issue 16). Run from the
# project root on the GPU machine, after the line ../shared/gpu/wheels.sh printed (it installs the
# wheels and sets PYTHONPATH), with OUT set to a folder for the results:
#
#   <wheels line> && OUT=out/gpu bash bench/gpu_trainer.sh
#
# 1. The step benchmark on a ~0.5B Qwen3-shaped model (random init, built from a config): the plain
#    HF reference loop against flywheel's step with its defaults (packed, logprobs where trained,
#    the MLPs' activations recomputed), on the same samples in the same run: tokens/s, peak memory, MFU.
# 2. Flywheel's step with whole blocks recomputed, and with nothing recomputed, same samples: which
#    default the GPU wants.
# 3. A 7B-shaped model (random init, fp32 master on the GPU) with LoRA rank 16: one step of ~32k
#    tokens must train without running out of memory.
# 4. The packing, chunked-logprob and compute unit tests, whose CUDA cases (flash varlen attention
#    in bf16 against padded rows) run only there, and the codec's CUDA tests.
# Each part has its own time limit, so one that hangs or fails leaves the others' results.
set -uo pipefail
# shellcheck source=bench/gpu_parts.sh
source "$(dirname "$0")/gpu_parts.sh"  # $out, $py, part

part step 110 "$py" -m bench.trainer_step --device cuda --json "$out/step.json"
part step-block 35 "$py" -m bench.trainer_step --device cuda --loops flywheel \
  --set activation_checkpointing=block --json "$out/step-block.json"
part step-none 35 "$py" -m bench.trainer_step --device cuda --loops flywheel \
  --set activation_checkpointing=none --json "$out/step-none.json"
part lora-7b 60 "$py" -m bench.trainer_step --device cuda --shape 7b --loops flywheel --set lora_rank=16 \
  --json "$out/lora-7b.json"
part unit 45 "$py" -m pytest -q -p no:cacheprovider tests/unit/test_packing.py tests/unit/test_compute.py \
  tests/unit/test_codec_device.py
echo "done: $(cat "$out/summary.txt" | tr '\n' ';')"
