"""The package version, in one place (read by setuptools and ``straggler --version``)."""

__version__ = "0.1.0"
