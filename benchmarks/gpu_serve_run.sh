#!/usr/bin/env bash
# The serving path on a GPU machine of the device tool (docs/log/2026-11-28-benchmarks-history.md, "Fourth run: serving
# on one NVIDIA H100"). Here: `python benchmarks/gpu_check.py --pack-serve` (three parts in .gpu_serve/). There: one
# call per part but the last, each carrying its part, `python3 benchmarks/gpu_check.py --receive .gpu_serve/PART
# --no-check`; then one call carrying the last part runs this script, which keeps that part, installs (transformers,
# gguf and the serving extra's wheels into /tmp/site, the embedded GGUF into hf_specdec's cache, hf_specdec editable),
# then runs serve_replay.py in process (which also fills Triton's disk cache) and one bench-serve round, each under its
# own time limit, their output under $OUT. A later call on the warm machine needs only `export PYTHONPATH=/tmp/site`.
#   bash benchmarks/gpu_serve_run.sh .gpu_serve/bundle-DIGEST.part-3-of-3
set -uo pipefail
part=$1
out=${OUT:-/tmp/gpu_serve_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 benchmarks/gpu_check.py --receive "$part" --no-check || exit 1
bundle=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_check_bundle as b; print(b.unpack())") \
    || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$bundle"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
cache=${HF_SPECDEC_CACHE:-$HOME/.cache/hf_specdec}/smollm2-135m-instruct
mkdir -p "$cache" && cp "$bundle"/models/smollm2-135m-instruct/*.gguf "$cache"/ || exit 1
nvidia-smi -L
python3 -c "import torch, transformers, triton, hf_specdec; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
echo "install: $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout "${REPLAY_S:-180}" python3 benchmarks/serve_replay.py --device cuda --dtype float32 --threads 16 \
    --configs "${REPLAY_CONFIGS:-off,ngram,ngram-unchecked,eagle,eagle-unchecked}" --rounds "${REPLAY_ROUNDS:-2}" \
    --rate 8 2>&1 | tee "$out/serve_replay.txt"
echo "serve_replay: $(( $(date +%s) - t1 )) s"
t2=$(date +%s)
timeout "${SERVE_S:-200}" python3 -m hf_specdec bench-serve --device cuda --dtype float32 --speculators ngram,eagle \
    --requests 32 --rate 8 --max-batch-size 32 --repeats 1 --out "$out/bench_serve_fp32.json" 2>&1 \
    | tee "$out/bench_serve.txt"
echo "bench-serve: $(( $(date +%s) - t2 )) s; total $(( $(date +%s) - t0 )) s"
