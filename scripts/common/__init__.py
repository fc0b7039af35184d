"""What every stage uses: atomic files, config checks, label names, geometry in mm, retries, the CPUs, CLIs."""

from scripts import lazy_submodules

__getattr__ = lazy_submodules(__name__)
