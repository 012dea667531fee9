"""Several gateways, one fleet: a lease in the shared store says which gateway leads the
controller; the others follow the replica set it publishes and take over when it dies."""
