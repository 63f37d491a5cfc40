#!/usr/bin/env bash
# The drafter recipe's GPU stage on a lent device machine (docs/benchmarks/issue-35-amphista.md,
# sections o and p). What the run needs beside the repository (the base GGUF, the pack, the shipped
# drafters' weights and the `gguf` package, which the device's transformers needs to read a GGUF) is
# one xz payload, 120 MB or so: a call carries at most 64 MiB with the tree, so `prepare` splits it
# into pieces that fit beside the tree (which grows with the committed corpus), one call each.
#
#   here:    scripts/device_drafters.sh prepare          # .xfer/piece.*, the weight files out of the index
#   device:  scripts/device_drafters.sh receive          # each call but the last, carrying one piece
#   device:  scripts/device_drafters.sh run ARGS...      # the last call, carrying the last piece
#   here:    scripts/device_drafters.sh restore          # the weight files back in the index
#   here:    scripts/device_drafters.sh collect DIR      # DIR = the last call's files_at: parts into the
#                                                        # corpus, drafters into build/gpu_run
# Calls follow one another at once: the machine keeps /tmp for 30 s after a call. run's ARGS go to
# `train_smollm2_drafters.py --stage cuda` (e.g. --budget 540 --gen-share 0.8 --min-passes 2 --init
# medusa_trt/assets/smollm2 --lr 3e-4 --batch-samples 32). Its new corpus parts, log, report and
# drafters (a tar in 15 MiB pieces: 8 files of 16 MiB at most come back) land in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${GGUF:-build/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
PACK=${PACK:-build/pack_v9.npz}
WEIGHTS="assets/demo_model/base/model.safetensors assets/demo_model/heads/medusa_lm_head.safetensors
  medusa_trt/assets/smollm2/heads/medusa_lm_head.safetensors medusa_trt/assets/smollm2/amphista/amphista.safetensors"
EXCLUDE=.git/info/exclude
X=/tmp/x  # on the device

case "${1:-}" in
prepare)
  for f in "$GGUF" "$PACK"; do [ -f "$f" ] || { echo "$f: missing; expected the base GGUF and the pack (--stage pack)" >&2; exit 2; }; done
  rm -rf .xfer && mkdir -p .xfer/payload/w .xfer/payload/py
  grep -qx /.xfer/ "$EXCLUDE" 2>/dev/null || echo /.xfer/ >>"$EXCLUDE"
  # the pack without its teacher-forced answers, which the cuda stage does not read
  .venv/bin/python -c "import numpy as np, sys; z = np.load(sys.argv[1]); np.savez(sys.argv[2], **{k: z[k] for k in z.files if not k.startswith('forced')})" "$PACK" .xfer/payload/pack.npz
  ln -s "$(realpath "$GGUF")" .xfer/payload/m.gguf
  cp medusa_trt/assets/smollm2/heads/medusa_lm_head.safetensors medusa_trt/assets/smollm2/amphista/amphista.safetensors .xfer/payload/w/
  site=$(.venv/bin/python -c "import gguf, pathlib; print(pathlib.Path(gguf.__file__).parents[1])")
  cp -r "$site"/gguf "$site"/gguf-*.dist-info .xfer/payload/py/  # the dist-info too: transformers reads its version
  git rm -q --cached --ignore-unmatch $WEIGHTS  # a second prepare before restore finds them out already
  for w in $WEIGHTS; do grep -qxF "/$w" "$EXCLUDE" || echo "/$w" >>"$EXCLUDE"; done
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
  piece=$(( 64 * 1048576 - tree - 1048576 ))  # a MiB to spare
  tar -C .xfer/payload -ch . | xz -9 -T2 | split -b "$piece" - .xfer/piece.
  rm -rf .xfer/payload
  n=$(ls .xfer/piece.* | wc -l)
  echo "tree $((tree / 1024)) KiB, payload $(( $(du -cb .xfer/piece.* | tail -1 | cut -f1) / 1048576 )) MiB: $n calls, each carrying one of:" $(ls .xfer/piece.*)
  echo "the weight files are out of the index: run '$0 restore' after the calls, before any commit"
  ;;
receive)
  mkdir -p $X && cp .xfer/piece.* $X/ && ls $X && nvidia-smi -L
  ;;
run)
  shift
  cp .xfer/piece.* $X/ 2>/dev/null || true
  mkdir -p $X/payload && cat $X/piece.* | xz -d | tar -x -C $X/payload \
    || { echo "$X/piece.*: not a whole payload ($(ls $X)); expected every piece, the earlier ones by 'receive' calls" >&2; exit 2; }
  cp $X/payload/w/medusa_lm_head.safetensors medusa_trt/assets/smollm2/heads/
  cp $X/payload/w/amphista.safetensors medusa_trt/assets/smollm2/amphista/
  export PYTHONPATH=$X/payload/py PYTHONUNBUFFERED=1
  rm -rf $X/run  # a retried run on the same machine must not send back the last run's report and drafters
  rc=0
  # Stopped short of the call's limit so that what it saved is sent back: RUN_LIMIT s for timeout_s
  # 600. With less device time left, the call's limit is less: RUN_LIMIT = that limit - 25, and
  # --budget = RUN_LIMIT - 35 (the unpack takes ~10 s, the imports ~8 s).
  timeout "${RUN_LIMIT:-575}" python3 scripts/train_smollm2_drafters.py --stage cuda --gguf $X/payload/m.gguf \
    --pack $X/payload/pack.npz --out $X/run --corpus-out "$OUT" "$@" >"$OUT/log.txt" 2>&1 || rc=$?
  if [ "$rc" = 124 ]; then  # timeout's code, which the device tool would read as its own time limit
    echo "stopped at RUN_LIMIT ${RUN_LIMIT:-575} s; what it saved is in $OUT" >&2
    rc=3
  fi
  # what the run saved comes back even if it failed: its drafters are saved at each validation
  [ -f $X/run/cuda_report.json ] && cp $X/run/cuda_report.json "$OUT/"
  saved=$(cd $X/run 2>/dev/null && ls -d amphista heads 2>/dev/null || true)
  [ -n "$saved" ] && (cd $X/run && tar -c $saved) | split -b 15M - "$OUT/drafters.tar."
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
  rm -rf build/gpu_run && mkdir -p build/gpu_run  # a report or eval of an earlier run would pass as this one's
  cp "$from"/cuda_report.json "$from"/log.txt build/gpu_run/ 2>/dev/null || true  # a run that saved no drafters too
  chmod u+w build/gpu_run/cuda_report.json build/gpu_run/log.txt 2>/dev/null || true
  if ls "$from"/drafters.tar.* >/dev/null 2>&1; then
    cat "$from"/drafters.tar.* | tar -x -C build/gpu_run
    echo "drafters in build/gpu_run; score them here: python scripts/train_smollm2_drafters.py --stage eval --device cpu --gguf $GGUF --pack $PACK --drafters build/gpu_run --out build/gpu_run/eval"
  fi
  ;;
*)
  sed -n '2,19p' "$0" >&2
  exit 2
  ;;
esac
