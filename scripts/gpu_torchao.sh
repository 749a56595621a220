# Sourced by scripts/gpu_checks.sh and scripts/gpu_tracks.sh (the GPU image has no torchao): where python3 cannot
# import it, install the carried wheel (.whl/) into /tmp/site and put that on PYTHONPATH; return 1 if the install
# fails. A dry run (GPU_CHECKS_DRY_RUN) needs no GPU packages and installs nothing. gpu_tracks.sh sources it once
# before its tracks start: two installs into one folder at once could leave it half written.
if [ -z "${GPU_CHECKS_DRY_RUN:-}" ] && ! python3 -c "import torchao" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
