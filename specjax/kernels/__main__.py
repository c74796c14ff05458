"""python -m specjax.kernels: builds the CPU kernel for this machine (make runs it); without a compiler it says so
and products stay XLA's."""

import subprocess
import sys

from specjax import kernels
from specjax.errors import MissingInputError

try:
    print(f"built {kernels.build()}")
except (MissingInputError, subprocess.CalledProcessError) as e:
    print(f"warning: the CPU kernel was not built ({e}); multi-row products stay XLA's", file=sys.stderr)
