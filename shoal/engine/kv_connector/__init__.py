"""The KV connector: how K/V moves between engines (prefill/decode disaggregation), behind one
interface with two sides.

- The scheduler's side (`scheduler_side.KVConnectorScheduler`) says how many of a request's
  tokens arrive from outside instead of being computed, and which finished requests keep their
  blocks for a handoff, until it is released or times out.
- The worker's side (`worker_side.KVConnectorWorker`) holds the KV pools it was registered with,
  loads arriving K/V into a request's blocks, saves a request's K/V out, and counts the transfers
  it finished.
- Between engines a request's K/V moves packed (`packing`), as one frame (`frames`), over a
  transport (`transports`: shared memory on one host, TCP between hosts).

The HTTP routes that carry it (`/kv/pull`, `/kv/release`) are the server's (shoal.server.
kv_connector); the engine knows nothing of HTTP."""
