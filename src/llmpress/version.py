"""The package version, at the foot of the floors (what a work folder or a run record names)."""

__version__ = "0.1.0"
