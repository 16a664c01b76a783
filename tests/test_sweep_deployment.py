"""The sweep deployment end to end: `prefect deploy --all` from prefect.yaml on a real Prefect server, a
`process` worker running `atrlhf-sweep/staleness-sweep` from this checkout (shrunk to two points on the
in-process threads host), the points as child flow runs of atrlhf-train, one MLflow parent with its children,
the comparison artifacts.

The server, deploy and worker fixtures are those of tests/test_deployment.py.
"""

from __future__ import annotations

import copy

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
)
from prefect.deployments import run_deployment
from prefect.states import StateType
from test_deployment import SMALL, deployed, server, wait_final, work  # noqa: F401 - fixtures

from rlhf_core.config import apply_overrides

pytestmark = pytest.mark.slow


def test_sweep_deployment_run_by_a_worker(deployed, work):  # noqa: F811 - fixtures
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("atrlhf-sweep/staleness-sweep")
    params = copy.deepcopy(deployment.parameters)
    assert params["grid"] == {"algorithm.loss": ["grpo", "m2po"], "runtime.max_staleness": [1, 4]}
    assert params["seeds"] == 2 and deployment.entrypoint == "flows/sweep.py:sweep"
    db = work / "sweep_mlflow.db"
    base = apply_overrides(
        params["base_config"],
        [
            *SMALL,
            "tracking.log_system_metrics=false",
            "cluster.host=threads",  # the points in the worker's process (no Ray: test_sweep.py runs Ray sweeps)
            f"run.output_dir={work / 'sweep'}",
            f"tracking.tracking_uri=sqlite:///{db}",
        ],
    )
    flow_run = run_deployment(
        "atrlhf-sweep/staleness-sweep",
        parameters={"base_config": base, "grid": {"runtime.max_staleness": [1, 4]}, "seeds": 1},
        timeout=0,
    )
    state = wait_final(flow_run.id, 600, deployed["worker_log"])
    assert state.type == StateType.COMPLETED, state.message

    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
        point_tasks = {t.id for t in task_runs if t.name.startswith("runtime.max_staleness=")}
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))
        )
        artifacts = {
            a.key
            for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
            )
        }
    assert len(point_tasks) == 2
    assert sorted(c.name.split(" (", 1)[0] for c in children) == ["max_staleness=1,seed=0", "max_staleness=4,seed=0"]
    # each child is nested in the sweep's flow run (Prefect links a subflow to a task run of its parent run)
    sweep_tasks = {t.id for t in task_runs}
    seen = [(c.name, c.state.type, c.state.message, c.parent_task_run_id in sweep_tasks) for c in children]
    assert all(c.state.type == StateType.COMPLETED and c.parent_task_run_id in sweep_tasks for c in children), seen
    assert {"atrlhf-sweep-comparison", "atrlhf-sweep-summary"} <= artifacts

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("asynctensorrlhf")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`atrlhf.sweep_role` = 'parent'")
    assert parent.info.status == "FINISHED" and parent.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    kids = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(k.data.tags["runtime.max_staleness"] for k in kids) == ["1", "4"]
    assert all(k.info.status == "FINISHED" for k in kids)
    assert {k.data.tags["prefect.flow_run_id"] for k in kids} == {str(c.id) for c in children}
