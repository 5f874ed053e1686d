#!/usr/bin/env bash
# A GPU discovery script for machines without GPUs (tests, laptops): it advertises
# SPARKDIST_FAKE_GPUS fake devices (default 2) so Spark's GPU scheduling can be exercised.
# Never use it on a real GPU cluster: use getGpusResources.sh there.
count="${SPARKDIST_FAKE_GPUS:-2}"
addresses=""
for ((i = 0; i < count; i++)); do
  addresses+="${addresses:+,}\"$i\""
done
echo "{\"name\": \"gpu\", \"addresses\": [$addresses]}"
