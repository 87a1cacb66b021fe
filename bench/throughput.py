"""Throughput benchmark across backends, pipelines and num_workers (the main job: ``make bench``).

Usage: ``python bench/throughput.py [--data ROOT] [--workers 0,1,2] [--backends ...] [--json PATH]``.
All options: ``python bench/throughput.py --help``. The implementation is ``bench/_harness``.
"""

import sys

from _harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
