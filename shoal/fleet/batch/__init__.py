"""The batch lane: OpenAI Files and Batch API, its durable store and its runner."""
