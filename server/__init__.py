"""llamastream's gRPC server: validation, the RPC <-> engine bridge, health, reflection, CLI."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """llamastream's installed version."""
    try:
        return version("llamastream")
    except PackageNotFoundError:  # (run from a checkout that was never installed)
        return "(not installed)"
