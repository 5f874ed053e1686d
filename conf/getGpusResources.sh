#!/usr/bin/env bash
# Spark GPU discovery script (spark.executor.resource.gpu.discoveryScript and
# spark.driver.resource.gpu.discoveryScript): prints the GPUs nvidia-smi sees as
#   {"name": "gpu", "addresses": ["0", "1", ...]}
# Spark hands each task a subset of these addresses; sparkdist turns them into
# CUDA_VISIBLE_DEVICES and LOCAL_RANK for the ranks of that task.
set -euo pipefail
addresses=$(nvidia-smi --query-gpu=index --format=csv,noheader | sed -e 's/^ *//' -e 's/.*/"&"/' | paste -sd, -)
echo "{\"name\": \"gpu\", \"addresses\": [${addresses}]}"
