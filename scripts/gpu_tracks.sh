#!/bin/bash
# One-GPU steps of scripts/gpu_checks.sh side by side, one track per GPU of a multi-GPU machine, inside one time limit
# (a machine's time is scarce: a 2-GPU machine runs two one-GPU tracks for the price of one):
#   bash scripts/gpu_tracks.sh SECONDS "ENV|STEPS" "ENV|STEPS" ...
#   bash scripts/gpu_tracks.sh 550 "FAMILY_FLAVORS=deepseek_v3_16b|resume_check families" \
#       "PARITY_FAMILY=deepseek_v3 PARITY_LEGS=bf16,bf16-seed2|parity_family"
# Track i runs `bash scripts/gpu_checks.sh STEPS` on GPU i (CUDA_VISIBLE_DEVICES=i; with GPU_TRACKS_GPUS=K, on GPUs
# iK..iK+K-1: two 2-GPU tracks on a 4-GPU machine) with its OUT in
# ${GPU_TRACKS_WORK:-/tmp/gpu_tracks}/track<i> (its log there: track.log), and the
# track's ENV (space-separated NAME=VALUE; a + in a VALUE stands for a space: PEER_AC=none+selective). A folder
# $GPU_TRACKS_SEED/track<i>, when given, is copied into the track's OUT first: finished parity legs of an earlier
# call are reused so. At SECONDS every track still running is stopped (what it wrote stays), the last lines of each
# track's log are printed, and $OUT/tracks.tgz holds every track's folder (traces and checkpoints left out: $OUT is
# what a GPU machine hands back, so the folders themselves stay outside it). Timings
# of two tracks are each their own GPUs'; they share the host's cores (a 2-GPU machine here has 32, a 4-GPU one 64).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
CHECKS=${GPU_CHECKS:-scripts/gpu_checks.sh}
limit=$1; shift
per=${GPU_TRACKS_GPUS:-1}
[ $# -ge 1 ] || { echo "usage: bash scripts/gpu_tracks.sh SECONDS \"ENV|STEPS\" ..." >&2; exit 2; }
WORK=${GPU_TRACKS_WORK:-/tmp/gpu_tracks}
mkdir -p "$OUT" "$WORK"; rm -rf "$WORK"/track*  # an earlier call's tracks
start=$(date +%s)
source scripts/gpu_torchao.sh || exit 1  # once, before the tracks (each track's gpu_checks.sh then finds it)
pids=() i=0
for spec in "$@"; do
  out="$WORK/track$i"
  mkdir -p "$out"
  [ -n "${GPU_TRACKS_SEED:-}" ] && [ -d "$GPU_TRACKS_SEED/track$i" ] && cp -r "$GPU_TRACKS_SEED/track$i/." "$out/"
  read -ra env_words <<< "${spec%%|*}"
  env_words=("${env_words[@]//+/ }")
  gpus=$(seq -s, $((i * per)) $((i * per + per - 1)))
  setsid env CUDA_VISIBLE_DEVICES=$gpus OUT="$out" "${env_words[@]}" bash "$CHECKS" ${spec#*|} > "$out/track.log" 2>&1 &
  pids+=($!) i=$((i + 1))
done
while [ $(( $(date +%s) - start )) -lt "$limit" ]; do
  running=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && running=1; done
  [ $running = 0 ] && break
  sleep 2
done
for i in "${!pids[@]}"; do
  if kill -0 "${pids[$i]}" 2>/dev/null; then  # its own session: the track's torchrun and python processes too
    kill -- -"${pids[$i]}" 2>/dev/null; sleep 1; kill -9 -- -"${pids[$i]}" 2>/dev/null
    echo "[track $i] stopped at the ${limit} s limit" >> "$WORK/track$i/track.log"
  else
    wait "${pids[$i]}"; echo "[track $i] exit $?" >> "$WORK/track$i/track.log"
  fi
  tail -n "${GPU_TRACKS_TAIL:-25}" "$WORK/track$i/track.log" | sed "s/^/[track $i] /"
done
echo "tracks done after $(( $(date +%s) - start )) s"
tar czf "$OUT/tracks.tgz" -C "$WORK" --exclude='*.json.gz' --exclude='*.distcp' --exclude='checkpoint' \
  $(for i in "${!pids[@]}"; do echo track$i; done)
