#!/bin/bash
set -euo pipefail
grep -c ERROR /app/data/log.txt > /app/answer.txt
