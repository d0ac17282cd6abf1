# Sourced by the GPU check scripts (bench/gpu_*.sh): the results folder, the card's name and the
# package versions, and `part`, which runs one part of a check under its own time limit, its
# output in "$out/<name>.log" and its exit status and duration in "$out/summary.txt".
out=${OUT:?set OUT to the results folder}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
"$py" -c 'import torch, transformers, numba; print(torch.__version__, torch.version.cuda, transformers.__version__,
numba.__version__)' > "$out/versions.txt" 2>&1

part() {  # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.txt"
}
