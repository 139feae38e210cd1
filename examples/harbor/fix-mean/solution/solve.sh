#!/bin/bash
# The reference fix: divide by the number of values.
set -euo pipefail
sed -i 's|total(values) / (len(values) + 1)|total(values) / len(values)|' /app/stats/core.py
