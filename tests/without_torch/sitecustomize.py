"""Start-up of a test's child process whose PYTHONPATH leads here (`children.child_env`): PyTorch is not found, as in
specjax's base install (the test extras add it for the reference tests). The path finder skips `torch`, so an import
fails and `importlib.util.find_spec` answers None, as when it is not installed."""

import importlib.machinery
import sys


class PathFinderWithoutTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [
    PathFinderWithoutTorch if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
]
