"""The package version, in one place (read by ``ccft.__version__`` and written into ``ccft.json``)."""

__version__ = "0.1.0"
