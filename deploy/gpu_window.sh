#!/usr/bin/env bash
# Head training on a lent GPU through the device tool, within its limits (docs/results.md,
# section 25). A call sends the tracked files and the paths it carries, 64 MiB in all, and
# brings back at most 64 MiB from $OUT, in files of at most 16 MiB; a machine stays warm 30 s
# after a call. The bundled target's GGUF is 98 MB and the shipped heads 67 MB, so:
#
#   here    deploy/gpu_window.sh prepare        .device/: the GGUF in parts, the gguf wheel, sizes
#           git switch -c gpu-slim && git rm -rq assets/heads && git commit -qm "device calls"
#   call 1  deploy/gpu_window.sh stage          carry .device/part-0 .device/target.sha256
#   call 2  deploy/gpu_window.sh train ARGS     carry .device/part-1 .device/target.sha256
#                                                     .device/whl (within 30 s of call 1)
#   here    git switch main && git branch -D gpu-slim
#           deploy/gpu_window.sh collect FILES_AT runs/gpu
#
# `train` runs `python3 -m eagle_engine train --target <the GGUF> --out <stash>/out
# --work-dir <stash>/work ARGS` and puts <stash>/out in $OUT as a tar in 15 MiB pieces. The
# stash ($EAGLE_DEVICE_STASH, default /root/eagle-device) lies outside the repository, where a
# warm machine keeps it between calls. Not here: what to train (the ARGS, section 25).
set -euo pipefail

stash=${EAGLE_DEVICE_STASH:-/root/eagle-device}
limit=$((64 * 1024 * 1024))

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# the carried parts of the target, kept in the stash
keep_parts() {
  mkdir -p "$stash"
  for part in .device/part-*; do
    [ -e "$part" ] && cp "$part" "$stash/"
  done
  cp .device/target.sha256 "$stash/"
  echo "stash $stash: $(ls "$stash" | tr '\n' ' ')"
}

case ${1:-} in
  prepare)  # here: the target in ${2:-2} parts and the gguf wheel for the device's Python 3.12
    parts=${2:-2}
    gguf=$(python3 -c "from eagle_engine.models.loader import bundled_gguf_path as p; print(p())")
    rm -rf .device && mkdir -p .device/whl
    size=$(stat -c %s "$gguf")
    split -b $(((size + parts - 1) / parts)) -d -a 1 "$gguf" .device/part-
    echo "$(sha256sum < "$gguf" | cut -d' ' -f1) $(basename "$gguf")" > .device/target.sha256
    version=$(python3 -c "from importlib.metadata import version; print(version('gguf'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d .device/whl "gguf==$version"
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    echo "tracked files: $(mib "$tree") (heads: $(mib "$(du -cb assets/heads | tail -1 | cut -f1)"))"
    for part in .device/part-*; do
      extra=$(du -cb "$part" .device/target.sha256 .device/whl | tail -1 | cut -f1)
      total=$((tree + extra))
      verdict=$([ "$total" -le "$limit" ] && echo "fits" || echo "OVER the 64 MiB limit")
      echo "a call carrying $part: $(mib "$total") with the tracked files, $verdict"
    done
    ;;
  stage)  # device, first call
    keep_parts
    ;;
  train)  # device, the window: the target assembled and checked, gguf installed, the run
    shift
    keep_parts
    read -r sum name < "$stash/target.sha256"
    cat "$stash"/part-* > "$stash/$name"
    if [ "$(sha256sum < "$stash/$name" | cut -d' ' -f1)" != "$sum" ]; then
      echo "error: $stash/$name does not match target.sha256 (parts: $(ls "$stash"/part-*))" >&2
      exit 2
    fi
    if ! python3 -c "import gguf" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    status=0
    python3 -m eagle_engine train --target "$stash/$name" --out "$stash/out" \
      --work-dir "$stash/work" "$@" || status=$?
    if [ -d "$stash/out" ]; then  # what was written, also after a failure
      tar -C "$stash" -cf - out | split -b 15M -d -a 1 - "${OUT:?}/out.tar.part-"
      ls -l "$OUT"
    fi
    exit $status
    ;;
  collect)  # here: FILES_AT (the run's files) -> DEST/out
    mkdir -p "$3"
    cat "$2"/out.tar.part-* | tar -C "$3" -xf -
    ls -R "$3/out"
    ;;
  *)
    echo "usage: deploy/gpu_window.sh prepare [PARTS] | stage | train TRAIN_ARGS... | collect FILES_AT DEST" >&2
    exit 2
    ;;
esac
