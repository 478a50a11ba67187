#!/usr/bin/env bash
# Uploads the playground to a Hugging Face Space through the Hub's HTTP API (`hf`, from
# huggingface_hub), which stores weights through LFS/Xet as `.gitattributes` says, so no git
# push and no local git-lfs are needed:
#
#     hf auth login                                     # once, a token with write access
#     bash deploy/upload_space.sh USER/NAME cpu-basic   # or cpu-upgrade, t4-small, l4x1, ...
#
# Creates the Space with that hardware when it does not exist (an existing Space keeps its
# hardware: change it in its settings). On CPU hardware it uploads
# `deploy/cpu-space-pre-requirements.txt` as `pre-requirements.txt` first, so that the Space
# installs the CPU build of torch; on GPU hardware it deletes that file from the Space. Then it
# uploads what the app needs: app.py, requirements.txt, README.md (the Space's configuration),
# .gitattributes, eagle_engine/, playground/ and assets/ (not the EAGLE-3.1 head the app does not
# load).
# `HF` names the CLI (tests put a stand-in there).
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: bash deploy/upload_space.sh USER/NAME HARDWARE (cpu-basic, cpu-upgrade, t4-small, l4x1, ...)" >&2
    exit 2
fi
space=$1 hardware=$2
hf=${HF:-hf}
cd "$(dirname "$0")/.."
"$hf" repos create "$space" --type space --sdk gradio --flavor "$hardware" --exist-ok
case $hardware in
    cpu-*)
        "$hf" upload "$space" deploy/cpu-space-pre-requirements.txt pre-requirements.txt \
            --type space --commit-message "CPU torch for the build" ;;
    *)
        prior=(--delete pre-requirements.txt) ;;
esac
"$hf" upload "$space" . . --type space ${prior[@]+"${prior[@]}"} \
    --include app.py --include requirements.txt --include README.md --include .gitattributes \
    --include 'eagle_engine/**' --include 'playground/**' --include 'assets/**' \
    --exclude 'assets/heads-eagle3.1/**' --exclude '**/__pycache__/**' --exclude '**/*.pyc' \
    --commit-message "EAGLE-3 Playground $(git rev-parse --short HEAD 2>/dev/null || echo upload)"
