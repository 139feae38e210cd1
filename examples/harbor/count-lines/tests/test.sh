#!/bin/bash
# Scores /app/answer.txt; writes reward.json with the reward and how the answer was read.
mkdir -p /logs/verifier
expected=$(grep -c ERROR /app/data/log.txt)
answer=$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null || true)
if [ "$answer" = "$expected" ]; then reward=1; else reward=0; fi
printf '{"reward": %s}\n' "$reward" > /logs/verifier/reward.json
