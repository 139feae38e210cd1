#!/bin/bash
# Runs the visible test and the hidden ones against /app; writes the reward Harbor reads.
mkdir -p /logs/verifier
cd /app
if python3 -m unittest discover -s /app -p 'test_*.py' \
   && PYTHONPATH=/app python3 -m unittest discover -s /tests -p 'test_*.py'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
