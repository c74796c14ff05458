"""python -m specjax.kernels: builds the CPU kernels for this machine where they are missing or were built from other
sources or for another CPU (make runs it every time); without a compiler it says so and XLA's stay in use."""

import subprocess
import sys

from specjax import kernels
from specjax.errors import MissingInputError

why = kernels.stale()
if why is None:
    print(f"{kernels.LIBRARY} is up to date")
else:
    try:
        print(f"{why}; building it", flush=True)
        print(f"built {kernels.build()}")
    except (MissingInputError, subprocess.CalledProcessError) as e:
        print(f"warning: the CPU kernels were not built ({e}); XLA's stay in use", file=sys.stderr)
