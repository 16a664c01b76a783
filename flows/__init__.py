"""Prefect flows: the control plane. `flows.train.train` is the supervised training flow;
`flows.deployment` is the `prefect deploy` build step that reads deployments/*.yaml."""
