#!/usr/bin/env bash
# The GPU check: the CUDA tests and GPU timings in one run, under 8 minutes on one H200.
#
# The accelerator machine has torch and an older transformers but no package registry, so what omnimtp
# needs on top travels as wheels in .device_wheels/ (git-ignored). On a machine with the registry:
#
#     bash scripts/device_check.sh --fetch-wheels          # fills .device_wheels/ (~40 MB)
#
# then on the accelerator machine (the `run` tool, with carry: [".device_wheels"]):
#
#     bash scripts/device_check.sh                         # JSON and logs under $OUT
#
# Steps (each under its own timeout; a failed step is recorded and the next one runs):
#   1. a virtualenv over the machine's torch with the carried wheels (transformers 5.24, ...)
#   2. the CUDA tests: tests/test_device.py (greedy codes equal transformers' on the GPU, seeded rows
#      batch-invariant) and the kernel-selection tests of tests/test_runtime.py
#   3. the code predictor frame at Qwen3-Omni's real dims (fp32, bf16; B = 1, 16): transformers' generate
#      vs our eager runner, same codes checked
#   4. end to end (tiny, mid): the thinker + talker + predictor + code2wav loop's real-time factor vs
#      transformers' generate on the same GPU
#   5. the MTP demo LM: τ and tokens/s, speculative k = 3 vs plain
# Environment: DEVICE (default cuda), OUT (default ./device_check_out), QUICK=1 for a smoke run (small
# cases; also how the script is tried on a CPU: DEVICE=cpu QUICK=1 SKIP_INSTALL=1).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device_wheels
PACKAGES=(transformers==5.24.0 "tokenizers>=0.21" "safetensors>=0.4" soundfile soxr pillow tqdm fastapi uvicorn
          prometheus-client pytest hypothesis openai httpx)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$WHEELS"
    pip download --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" "${PACKAGES[@]}" || exit 1
    # torch and numpy are the machine's own; hf-xet only speeds up hub downloads. The carry limit is
    # 64 MiB with the working tree (~20 MB), so they stay behind.
    rm -f "$WHEELS"/numpy-*.whl "$WHEELS"/hf_xet-*.whl
    du -sh "$WHEELS"
    exit 0
fi

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-device_check_out}
QUICK=${QUICK:-0}
mkdir -p "$OUT"
STATUS="$OUT/steps.txt"
: > "$STATUS"

step() {  # step NAME SECONDS COMMAND...: run it, log it, record its exit status
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - started))" | tee -a "$STATUS"
    tail -5 "$OUT/$name.log"
}

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    python3 -m venv --system-site-packages "$OUT/venv"
    # shellcheck disable=SC1091
    . "$OUT/venv/bin/activate"
    step install 120 pip install --no-index --no-deps "$WHEELS"/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMNIMTP_DEVICE="$DEVICE"
python - <<'PY' | tee "$OUT/environment.json"
import json, platform, torch, transformers
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
                  "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PY

step tests 240 python -m pytest -q -p no:warnings tests/test_device.py tests/test_runtime.py -k "device or cuda or kernel"

if [[ "$QUICK" == 1 ]]; then
    step code_predictor 240 python benchmarks/code_predictor.py --device "$DEVICE" --quick --threads 1 --compile none \
        --out "$OUT/code_predictor.json"
    step e2e 240 python benchmarks/e2e.py --device "$DEVICE" --quick --config tiny --compile none --out "$OUT/e2e.json"
    step mtp_demo 240 python benchmarks/mtp_demo.py --device "$DEVICE" --num-prompts 2 --ks 3 --max-new-tokens 16 \
        --repeats 1 --no-sampled --out "$OUT/mtp_demo.json"
else
    step code_predictor 150 python benchmarks/code_predictor.py --device "$DEVICE" --cases real-fp32 real-bf16 \
        --batch-sizes 1 16 --compile none --rounds 3 --threads 4 --out "$OUT/code_predictor.json"
    step e2e 150 python benchmarks/e2e.py --device "$DEVICE" --compile none --repeats 2 --threads 4 --out "$OUT/e2e.json"
    step mtp_demo 90 python benchmarks/mtp_demo.py --device "$DEVICE" --num-prompts 4 --ks 3 --max-new-tokens 64 \
        --repeats 1 --no-sampled --threads 4 --out "$OUT/mtp_demo.json"
fi
echo "steps: $(tr '\n' ';' < "$STATUS")"
! grep -qv "rc=0" "$STATUS"
