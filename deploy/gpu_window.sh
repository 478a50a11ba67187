#!/usr/bin/env bash
# Head training on a lent GPU through the device tool, within its limits. A call sends the
# tracked files and the paths it carries, 64 MiB in all, and
# brings back at most 64 MiB from $OUT, in files of at most 16 MiB; a machine stays warm 30 s
# after a call. The bundled target's GGUF is 98 MB and the shipped heads 67 MB, so:
#
#   here    deploy/gpu_window.sh prepare [PARTS [HEAD...]]
#                                                  .device/: the GGUF in parts, the gguf wheel,
#                                                  MT-bench; prints each call's size from a
#                                                  device branch without the shipped heads but
#                                                  HEAD... (a head that `--init-from` continues:
#                                                  the default head's 20 MB fit with 3 parts),
#                                                  and the commands that make that branch
#   device  deploy/gpu_window.sh stage             carry .device/part-0 .device/target.sha256
#           ... one call a part, each within 30 s of the last; the last call carries .device/whl
#           deploy/gpu_window.sh train ARGS        -> python3 -m eagle_engine train --target
#                                                  <the GGUF> --out <stash>/out ARGS
#           deploy/gpu_window.sh run 'COMMAND'     any command, with $EAGLE_TARGET the GGUF
#   here    git switch main && git branch -D gpu-slim
#           deploy/gpu_window.sh collect FILES_AT DEST
#
# The stash ($EAGLE_DEVICE_STASH, default /root/eagle-device) lies outside the repository,
# where a warm machine keeps it between calls. `train` and `run` put <stash>/out, when there is
# one, in $OUT as a gzipped tar in 15 MiB pieces, which `collect` unpacks (gzip -1 takes bf16
# heads to ~80%: three heads of the bundled target, 64.5 MB, come back as 51.4 MB; it warns when
# the pieces pass the 64 MiB the tool brings back). Not here: what to train (the
# ARGS; on an H200: leave --stop-after-minutes a minute above
# --max-minutes, for loading).
set -euo pipefail

stash=${EAGLE_DEVICE_STASH:-/root/eagle-device}
limit=$((64 * 1024 * 1024))

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

keep_parts() {  # the carried parts of the target, into the stash
  mkdir -p "$stash"
  for part in .device/part-* .device/target.sha256; do
    [ -e "$part" ] && cp "$part" "$stash/"
  done
  echo "stash $stash: $(ls "$stash" | tr '\n' ' ')"
}

ready_target() {  # the GGUF assembled and checked, gguf importable; exports EAGLE_TARGET
  keep_parts
  read -r sum name < "$stash/target.sha256"
  if [ ! -f "$stash/$name" ]; then
    cat "$stash"/part-* > "$stash/$name.tmp"
    if [ "$(sha256sum < "$stash/$name.tmp" | cut -d' ' -f1)" != "$sum" ]; then
      rm "$stash/$name.tmp"
      echo "error: the parts in $stash ($(ls "$stash" | tr '\n' ' ')) do not make the" \
           "GGUF of target.sha256: a part was not carried" >&2
      exit 2
    fi
    mv "$stash/$name.tmp" "$stash/$name"
  fi
  export EAGLE_TARGET=$stash/$name
  if ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

send_out() {  # <stash>/out -> $OUT, also after a failed command
  if [ -d "$stash/out" ]; then
    tar -C "$stash" -cf - out | gzip -1 | split -b 15M -d -a 1 - "${OUT:?}/out.tar.gz.part-"
    ls -l "$OUT"
    sent=$(du -cb "$OUT"/out.tar.gz.part-* | tail -1 | cut -f1)
    if [ "$sent" -gt "$limit" ]; then
      echo "warning: out is $(mib "$sent") gzipped, more than the 64 MiB the device tool" \
           "brings back: pieces past it stay behind; $stash/out stays on the warm machine" >&2
    fi
  fi
}

case ${1:-} in
  prepare)  # here
    parts=${2:-2}
    keep=("${@:3}")
    for head in "${keep[@]}"; do
      if [ ! -d "assets/heads/$head" ]; then
        echo "error: no shipped head assets/heads/$head" >&2
        exit 2
      fi
    done
    gguf=$(python3 -c "from eagle_engine.models.loader import bundled_gguf_path as p; print(p())")
    rm -rf .device && mkdir -p .device/whl
    size=$(stat -c %s "$gguf")
    split -b $(((size + parts - 1) / parts)) -d -a 1 "$gguf" .device/part-
    echo "$(sha256sum < "$gguf" | cut -d' ' -f1) $(basename "$gguf")" > .device/target.sha256
    version=$(python3 -c "from importlib.metadata import version; print(version('gguf'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d .device/whl "gguf==$version"
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    heads=$(git ls-files -z assets/heads assets/heads-eagle3.1 | xargs -0 -r du -cb | tail -1 | cut -f1)
    kept=0
    for head in "${keep[@]}"; do
      kept=$((kept + $(git ls-files -z "assets/heads/$head" | xargs -0 du -cb | tail -1 | cut -f1)))
    done
    sent=$((tree - ${heads:-0} + kept))
    echo "tracked files: $(mib "$tree") (heads: $(mib "${heads:-0}")); on the device branch," \
         "without the heads but ${keep[*]:-none}: $(mib "$sent")"
    drop=$(for d in assets/heads/*/ assets/heads-eagle3.1/*/; do  # the shipped heads not kept
      d=${d%/}
      [[ " ${keep[*]} " == *" ${d##*/} "* ]] || echo "$d"
    done)
    echo "the device branch: git switch -c gpu-slim && git rm -rq $(echo $drop) &&" \
         "git commit -qm \"device calls\""
    for part in .device/part-*; do
      total=$((sent + $(du -cb "$part" .device/target.sha256 .device/whl | tail -1 | cut -f1)))
      verdict=$([ "$total" -le "$limit" ] && echo "fits" || echo "OVER the 64 MiB limit")
      echo "a call carrying $part and the wheel: $(mib "$total") with the tracked files, $verdict"
    done
    ;;
  stage)  # device, every call but the last
    keep_parts
    ;;
  train)  # device
    shift
    ready_target
    status=0
    python3 -m eagle_engine train --target "$EAGLE_TARGET" --out "$stash/out" \
      --work-dir "$stash/work" "$@" || status=$?
    send_out
    exit $status
    ;;
  run)  # device
    ready_target
    status=0
    bash -c "$2" || status=$?
    send_out
    exit $status
    ;;
  collect)  # here: FILES_AT (the run's files) -> DEST/out
    mkdir -p "$3"
    cat "$2"/out.tar.gz.part-* | tar -C "$3" -xzf -
    ls -R "$3/out"
    ;;
  *)
    echo "usage: deploy/gpu_window.sh prepare [PARTS] | stage | train TRAIN_ARGS... |" \
         "run 'COMMAND' | collect FILES_AT DEST" >&2
    exit 2
    ;;
esac
