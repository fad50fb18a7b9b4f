"""The GPU check's CPU tests (fagen/bench), one module per section.

Their shared stand-ins (bench_stand_ins) and synthetic results (bench_synthetic) are plain modules
beside them: this folder goes on sys.path whatever pytest's import mode, as tests/ does for the
helpers there (kernel_cases and the others), which stay importable from here too.
"""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
