"""One model across processes: tensor-parallel ranks and pipeline stages, driven by the scheduler
in the engine's process (see `MultiprocExecutor`)."""
