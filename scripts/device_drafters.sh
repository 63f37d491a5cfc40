#!/usr/bin/env bash
# The drafter recipe's GPU stage on a lent device machine, in two calls of at most 64 MiB each
# (docs/benchmarks/issue-35-amphista.md, sections o and p). The base GGUF alone is 90 MB as xz, so
# call 1 carries its first 58 MiB and call 2 the rest, the pack, the drafters' weights and the
# `gguf` package (the device's transformers needs it to read a GGUF; it has no registry).
#
#   here:    scripts/device_drafters.sh prepare          # .xfer/, and the weight files out of the index
#   device:  scripts/device_drafters.sh call1            # carry .xfer/gguf.xz.aa
#   device:  scripts/device_drafters.sh call2 ARGS...    # carry .xfer/gguf.xz.ab .xfer/pack.npz.xz .xfer/w .xfer/py
#   here:    scripts/device_drafters.sh restore          # the weight files back in the index
#   here:    scripts/device_drafters.sh collect DIR      # DIR = the call's files_at: parts into the corpus,
#                                                        # drafters into build/gpu_run
# call2's ARGS go to `train_smollm2_drafters.py --stage cuda` (e.g. --budget 540 --gen-share 0.6
# --init medusa_trt/assets/smollm2 --lr 3e-4 --batch-samples 32). Its new corpus parts, log, report
# and drafters (a tar split in 15 MiB pieces: 8 files of 16 MiB at most come back) land in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${GGUF:-build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
PACK=${PACK:-build/pack_v6.npz}
WEIGHTS="assets/demo_model/base/model.safetensors assets/demo_model/heads/medusa_lm_head.safetensors
  medusa_trt/assets/smollm2/heads/medusa_lm_head.safetensors medusa_trt/assets/smollm2/amphista/amphista.safetensors"
EXCLUDE=.git/info/exclude

case "${1:-}" in
prepare)
  for f in "$GGUF" "$PACK"; do [ -f "$f" ] || { echo "$f: missing; expected the base GGUF and the pack (--stage pack)" >&2; exit 2; }; done
  rm -rf .xfer && mkdir -p .xfer/w .xfer/py
  grep -qx /.xfer/ "$EXCLUDE" 2>/dev/null || echo /.xfer/ >>"$EXCLUDE"
  # the pack without its teacher-forced answers (unused by the cuda stage): 9.7 MB as xz
  .venv/bin/python -c "import numpy as np, sys; z = np.load(sys.argv[1]); np.savez('.xfer/pack.npz', **{k: z[k] for k in z.files if not k.startswith('forced')})" "$PACK"
  xz -9 -T2 .xfer/pack.npz
  xz -9 -T2 -c "$GGUF" | split -b 58M - .xfer/gguf.xz.
  cp medusa_trt/assets/smollm2/heads/medusa_lm_head.safetensors medusa_trt/assets/smollm2/amphista/amphista.safetensors .xfer/w/
  site=$(.venv/bin/python -c "import gguf, pathlib; print(pathlib.Path(gguf.__file__).parents[1])")
  cp -r "$site"/gguf "$site"/gguf-*.dist-info .xfer/py/  # the dist-info too: transformers reads its version
  git rm -q --cached $WEIGHTS
  printf '/%s\n' $WEIGHTS >>"$EXCLUDE"
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
  echo "tree $((tree / 1024)) KiB; call 1 $(( ($(stat -c %s .xfer/gguf.xz.aa) + tree) / 1048576 )) MiB, call 2 $(( ($(du -cb .xfer/gguf.xz.ab .xfer/pack.npz.xz .xfer/w .xfer/py | tail -1 | cut -f1) + tree) / 1048576 )) MiB (64 at most)"
  echo "the weight files are out of the index: run '$0 restore' after the calls, before any commit"
  ;;
call1)
  mkdir -p /tmp/x && cp .xfer/gguf.xz.aa /tmp/x/ && nvidia-smi -L
  ;;
call2)
  shift
  [ -f /tmp/x/gguf.xz.aa ] || { echo "/tmp/x/gguf.xz.aa: missing; run call1 on this machine first (it stays 30 s)" >&2; exit 2; }
  cp .xfer/w/medusa_lm_head.safetensors medusa_trt/assets/smollm2/heads/
  cp .xfer/w/amphista.safetensors medusa_trt/assets/smollm2/amphista/
  [ -f /tmp/x/m.gguf ] || cat /tmp/x/gguf.xz.aa .xfer/gguf.xz.ab | xz -d -T0 >/tmp/x/m.gguf
  xz -dc .xfer/pack.npz.xz >/tmp/x/pack.npz
  export PYTHONPATH=$PWD/.xfer/py PYTHONUNBUFFERED=1
  rc=0
  python3 scripts/train_smollm2_drafters.py --stage cuda --gguf /tmp/x/m.gguf --pack /tmp/x/pack.npz \
    --out /tmp/x/run --corpus-out "$OUT" "$@" >"$OUT/log.txt" 2>&1 || rc=$?
  # what the run saved comes back even if it failed: its drafters are saved at each validation
  [ -f /tmp/x/run/cuda_report.json ] && cp /tmp/x/run/cuda_report.json "$OUT/"
  [ -d /tmp/x/run/amphista ] || [ -d /tmp/x/run/heads ] && (cd /tmp/x/run && tar -c $(ls -d amphista heads 2>/dev/null)) | split -b 15M - "$OUT/drafters.tar."
  tail -c 4000 "$OUT/log.txt"
  exit $rc
  ;;
restore)
  for w in $WEIGHTS; do grep -vxF "/$w" "$EXCLUDE" >"$EXCLUDE.new" || true; mv "$EXCLUDE.new" "$EXCLUDE"; done
  git add $WEIGHTS
  git status --short
  ;;
collect)
  from=${2:?collect DIR: the folder where the device call files came back}
  cp "$from"/part-*.npz.xz data/drafter_corpus/ 2>/dev/null && chmod 644 data/drafter_corpus/part-*.npz.xz || echo "$from: no corpus parts"
  if ls "$from"/drafters.tar.* >/dev/null 2>&1; then
    mkdir -p build/gpu_run && cat "$from"/drafters.tar.* | tar -x -C build/gpu_run
    cp "$from"/cuda_report.json "$from"/log.txt build/gpu_run/ 2>/dev/null || true
    echo "drafters in build/gpu_run; score them here: python scripts/train_smollm2_drafters.py --stage eval --device cpu --gguf $GGUF --pack $PACK --drafters build/gpu_run --out build/gpu_run/eval"
  fi
  ;;
*)
  sed -n '2,16p' "$0" >&2
  exit 2
  ;;
esac
