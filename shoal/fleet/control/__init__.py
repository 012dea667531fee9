"""Control: the controller (reconcile loop), replica set, autoscaler, rollout and its canary judge,
placement (memory), cores (CPU), history."""
