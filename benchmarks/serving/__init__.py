"""The serving benchmark's parts; `python -m benchmarks.bench_serving` is the command line.

- `configs`: the matched-memory configurations (paged vs contiguous at the same KV bytes)
- `measure`: per-request records, a pass's metrics, the one dict a measured pass reports
  (from the engine's counters before and after it), interleaved repeats
- `in_process`, `over_http`: the two ways to drive a configuration
- `report`: the table, ratios, target checks, step time breakdown and plot
- `pool_scan`, `decode_profile`: `--pool-scan` and `--decode-profile`
"""

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent  # benchmarks/
RESULTS_DIR = BENCH_DIR / "results"
