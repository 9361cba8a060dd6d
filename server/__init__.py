"""llamastream's gRPC server: validation, the RPC <-> engine bridge, health, reflection, CLI."""
