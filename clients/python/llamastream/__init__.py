"""llamastream's gRPC contract: the Python stubs generated from protos/ live in llamastream.v1."""
