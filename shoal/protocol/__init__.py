"""What replicas and the gateway share on the wire, free of torch and the engine: OpenAI error
bodies, the API-key check, strict JSON bodies, request limits, block hashing and seed derivation."""
