"""vgpu-sharing: share one NVIDIA GPU between many pods with hard memory and compute limits."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vgpu-sharing")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
