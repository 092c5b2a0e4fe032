import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = str(Path(__file__).parent)
if HERE not in sys.path:  # the pattern-file writers (pattern_files.py) are imported by the tests
    sys.path.insert(0, HERE)
