"""Control: the controller (reconcile loop), replica set, autoscaler, rollout, placement, history."""
