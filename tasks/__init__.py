"""Prefect tasks, one discrete observable step each (launch, evaluate, checkpoint, export, teardown), MLflow
tracking, and the health checks the training flow applies. Thin: the work is done by rlhf_core."""
