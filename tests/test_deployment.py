"""Deployments end to end: a real Prefect server on 127.0.0.1, `prefect deploy --all` from prefect.yaml, a
`process` worker running the flow from this checkout, MLflow on SQLite in a temp dir.

Covers: the deployments and their parameters, a deployment run to Completed, cancelling a running
deployment run (Cancelled, no Ray actor left, MLflow run KILLED), and bad configs at deploy time, at run
creation and inside the run (each fails fast, naming the field, with nothing half-started).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest

for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}.items():
    os.environ.setdefault(_key, _value)

from conftest import POOL, _prefect  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.deployments import run_deployment  # noqa: E402
from prefect.states import Cancelling, StateType  # noqa: E402

from rlhf_core.config import apply_overrides  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "trainer.total_steps=4",
    "data.eval_size=20",
    "model.preset=micro",
    "rollout.prompts_per_batch=4",
    "trainer.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "cluster.num_cpus=2",
    "supervision.supervise_interval_s=0.2",
    "eval.every=2",
    "checkpoint.every=2",
    "tracking.log_system_metrics=true",
]


@pytest.fixture(scope="module")
def server(prefect_api):
    """The session's Prefect server (tests/conftest.py), the API of this module's process."""
    return prefect_api


@pytest.fixture(scope="module")
def deployed(server, prefect_deployed):
    """The session's deployments and worker, with the server as this module's API."""
    return prefect_deployed


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("deploy_runs")


@pytest.fixture(scope="module")
def ray_address(ray_local):
    """The local Ray (tests/conftest.py) that the deployment runs join (cluster.address), so that the test can see
    their actors."""
    import ray

    return ray.get_runtime_context().gcs_address


def alive_actors() -> list[str]:
    from ray._private import state

    return [a for a, info in state.actors().items() if info["State"] != "DEAD"]


def deployment_config(name: str, work: Path, run: str, *extra: str) -> dict:
    """The config stored on a deployment, shrunk to a few steps and pointed at temp dirs."""
    with get_client(sync_client=True) as client:
        cfg = copy.deepcopy(client.read_deployment_by_name(f"atrlhf-train/{name}").parameters["config"])
    return apply_overrides(
        cfg,
        [
            *SMALL,
            f"run.output_dir={work / run}",
            f"tracking.run_name={run}",
            f"tracking.tracking_uri=sqlite:///{work / 'mlflow.db'}",
            *extra,
        ],
    )


def wait_final(flow_run_id, timeout_s: float, worker_log: Path):
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.is_final():
                return state
            assert time.monotonic() < deadline, (
                f"flow run not final after {timeout_s} s ({state}); worker log:\n" + worker_log.read_text()[-4000:]
            )
            time.sleep(0.5)


def mlflow_runs(work: Path, run_name: str) -> list:
    if not (work / "mlflow.db").exists():
        return []
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("asynctensorrlhf")
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'")


def test_deployments_from_prefect_yaml(deployed):
    with get_client(sync_client=True) as client:
        tiny = client.read_deployment_by_name("atrlhf-train/tiny-async")
        sync = client.read_deployment_by_name("atrlhf-train/sync-baseline")
        real = client.read_deployment_by_name("atrlhf-train/qwen2.5-0.5b-gsm8k")
    assert tiny.parameters["config"]["runtime"]["max_staleness"] == 2  # async
    assert tiny.parameters["config"]["run"]["output_dir"] == "runs/deployments/tiny-async"
    assert [s.schedule.cron for s in tiny.schedules] == ["0 3 * * *"] and not tiny.schedules[0].active
    assert sync.parameters["config"]["runtime"]["max_staleness"] == 0  # lockstep
    assert real.parameters["config"]["rollout"]["engine"] == "vllm"
    assert real.parameters["config"]["cluster"]["address"] == "auto"
    for d in (tiny, sync, real):
        assert d.work_pool_name == POOL
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        assert d.entrypoint == "flows/train.py:train"


def test_deployment_run_completes(deployed, work, ray_address):
    """`prefect deployment run` equivalent: the worker pulls the checkout and runs the flow, which joins Ray."""
    cfg = deployment_config("tiny-async", work, "deployed", f"cluster.address={ray_address}")
    start = time.perf_counter()
    flow_run = run_deployment("atrlhf-train/tiny-async", parameters={"config": cfg}, timeout=0)
    state = wait_final(flow_run.id, 300, deployed["worker_log"])
    assert state.type == StateType.COMPLETED, state.message
    (run,) = mlflow_runs(work, "deployed")
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2, 3, 4]
    assert any(k.startswith("system/") for k in run.data.metrics), "system metrics were on"
    assert (work / "deployed" / "latest" / "policy" / "config.json").is_file()
    assert not alive_actors(), "the run left Ray actors behind"
    # the worker's console is as quiet as `atrlhf train`'s: no "Finished in state Completed()" per task run, the
    # run's own lines still there
    shown = deployed["worker_log"].read_text()
    assert "held-out evaluation at step 4" in shown, shown[-3000:]
    assert "Finished in state Completed" not in shown, shown[-3000:]
    print(f"deployment run: {time.perf_counter() - start:.1f} s")


def test_cancel_deployment_run(deployed, work, ray_address):
    """Cancel a running deployment run: the worker SIGTERMs the flow, which tears down (no actor of it left
    on the Ray it joined) and ends its MLflow run KILLED; the flow run ends Cancelled."""
    cfg = deployment_config(
        "tiny-async",
        work,
        "cancelled",
        "trainer.total_steps=100000",
        "tracking.log_system_metrics=false",
        f"cluster.address={ray_address}",
    )
    flow_run = run_deployment("atrlhf-train/tiny-async", parameters={"config": cfg}, timeout=0)
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    deadline = time.monotonic() + 240
    while True:
        runs = mlflow_runs(work, "cancelled")
        if runs and client.get_metric_history(runs[0].info.run_id, "reward/mean"):
            break
        assert time.monotonic() < deadline, deployed["worker_log"].read_text()[-4000:]
        time.sleep(0.5)
    assert alive_actors(), "the run's actors are up"
    with get_client(sync_client=True) as pc:
        pc.set_flow_run_state(flow_run.id, Cancelling(message="test cancel"))
    state = wait_final(flow_run.id, 120, deployed["worker_log"])
    assert state.type == StateType.CANCELLED
    assert client.get_run(runs[0].info.run_id).info.status == "KILLED"
    deadline = time.monotonic() + 30
    while alive_actors():
        assert time.monotonic() < deadline, "cancellation left Ray actors behind"
        time.sleep(0.5)


def test_bad_config_rejected_when_the_run_is_created(deployed, work):
    cfg = deployment_config("tiny-async", work, "bad-type")
    cfg["trainer"]["total_steps"] = 0
    with pytest.raises(Exception) as err:
        run_deployment("atrlhf-train/tiny-async", parameters={"config": cfg}, timeout=0)
    assert "total_steps" in str(err.value)


def test_bad_config_fails_the_run_fast(deployed, work):
    """Schema-valid but inconsistent (jsonl without data): the flow fails before launching anything."""
    cfg = deployment_config("tiny-async", work, "bad-cross", "data.task=jsonl")
    flow_run = run_deployment("atrlhf-train/tiny-async", parameters={"config": cfg}, timeout=0)
    state = wait_final(flow_run.id, 120, deployed["worker_log"])
    assert state.type == StateType.FAILED
    assert "data.train_path" in state.message
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    assert task_runs == [], "nothing may start on a bad config"
    assert not mlflow_runs(work, "bad-cross")
    assert not (work / "bad-cross").exists()


def test_bad_config_fails_prefect_deploy(server, deployed, tmp_path):
    params = tmp_path / "bad.yaml"
    params.write_text("config_file: configs/tiny.yaml\noverrides: [rollout.temperature=-1]\n")
    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(f"""
name: bad
pull:
  - prefect.deployments.steps.set_working_directory:
      directory: "{{{{ params.directory }}}}"
deployments:
  - name: bad
    entrypoint: flows/train.py:train
    work_pool: {{name: {POOL}}}
    build:
      - flows.deployment.load_parameters:
          id: params
          file: {params}
    parameters:
      config: "{{{{ params.config }}}}"
""")
    out = _prefect(["--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)], server["env"])
    assert out.returncode != 0
    assert "rollout.temperature" in out.stdout + out.stderr
    with get_client(sync_client=True) as client:
        names = [d.name for d in client.read_deployments()]
    assert "bad" not in names
