"""python -m specjax.kernels: builds the CPU kernels for this machine (make runs it); without a compiler it says so
and XLA's stay in use."""

import subprocess
import sys

from specjax import kernels
from specjax.errors import MissingInputError

try:
    print(f"built {kernels.build()}")
except (MissingInputError, subprocess.CalledProcessError) as e:
    print(f"warning: the CPU kernels were not built ({e}); XLA's stay in use", file=sys.stderr)
