"""llamastream's inference engine: everything that is not RPC."""
