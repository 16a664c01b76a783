"""Sweeps (flows/sweep.py, tasks/sweep.py, rlhf_core/sweep_grid.py, tracking/sweep_*.py,
`atrlhf sweep`): grid parsing, points, ids, per-point configs, the comparison table and plot; and, slow, a
sweep of the tiny task through the CLI with points that fail at run time and a rerun that skips the finished points
(real Prefect, real local Ray, MLflow on SQLite in a temp dir).
"""

from __future__ import annotations

import re

import pytest

from flows.cli import main, parse_grid
from flows.deployment import load_sweep_parameters
from rlhf_core.config import ConfigError, TrainConfig, load_config, parse_grid_item, validate_config
from rlhf_core.sweep_grid import SweepPoint, check_grid, check_points, expand_grid, point_config, seed_list, sweep_id
from tracking.sweep_comparison import (
    ChildHistory,
    comparison_plot,
    comparison_row,
    display_rows,
    read_child,
    table_csv,
    table_markdown,
)
from tracking.sweep_record import point_tags

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
    "tracking.log_system_metrics=false",
    "tracking.log_model=false",
]


def test_grid_values_parse_like_set_values():
    assert parse_grid_item("runtime.max_staleness=1,4,16") == ("runtime.max_staleness", [1, 4, 16])
    assert parse_grid_item("algorithm.loss=grpo,m2po") == ("algorithm.loss", ["grpo", "m2po"])
    assert parse_grid_item("trainer.lr=[0.0001, 0.0003]") == ("trainer.lr", [0.0001, 0.0003])
    assert parse_grid(["algorithm.loss=ppo", "trainer.lr_schedule=constant,cosine"]) == {
        "algorithm.loss": ["ppo"],
        "trainer.lr_schedule": ["constant", "cosine"],
    }
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["algorithm.loss=grpo", "algorithm.loss=m2po"])
    for bad in ("algorithm.loss", "a..b=1", "runtime.max_staleness=1,,4"):
        with pytest.raises(ConfigError):
            parse_grid_item(bad)


def test_cli_rejects_a_bad_grid_before_starting_anything(capsys):
    assert main(["sweep", "--grid", "algorithm.loss"]) == 2
    assert "dotted.key=value" in capsys.readouterr().err
    assert main(["sweep", "--grid", "algorithm.loss=m2po,nosuch"]) == 2  # a value: validated as --set would be
    assert "--grid algorithm.loss=nosuch: algorithm.loss: Value error, unknown policy loss" in capsys.readouterr().err
    assert main(["sweep", "--grid", "algorithm.los=m2po"]) == 2  # a key
    assert "--grid algorithm.los=m2po: algorithm.los: unknown field" in capsys.readouterr().err
    assert main(["sweep", "--grid", "algorithm.loss=grpo", "--seeds", "0"]) == 2
    assert main(["sweep", "--set", "trainer.total_steps=0", "--grid", "algorithm.loss=grpo"]) == 2
    assert "trainer.total_steps" in capsys.readouterr().err


def test_points_are_the_grid_times_the_seeds():
    base = load_config(None, ["trainer.seed=7"])
    seeds = seed_list(base, 2)
    assert seeds == [7, 8] and seed_list(base, [1, 5]) == [1, 5]
    points = expand_grid({"algorithm.loss": ["grpo", "m2po"], "runtime.max_staleness": [1, 4]}, seeds)
    assert len(points) == 8 and len({p.name for p in points}) == 8 and len({p.dirname for p in points}) == 8
    assert points[0].name == "algorithm.loss=grpo,runtime.max_staleness=1,seed=7"
    # run names lead with the varied values, keys shortened where unambiguous: they differ within 16 characters
    assert points[0].run_name("sweep-0123456789") == "loss=grpo,max_staleness=1,seed=7 (sweep-0123456789)"
    assert len({p.run_name("sweep-0123456789")[:16] for p in expand_grid({"runtime.max_staleness": [1, 4]}, [0])}) == 2
    (clash,) = expand_grid({"trainer.lr": [0.1], "critic.lr": [0.2]}, [0])
    assert clash.label == "trainer.lr=0.1,critic.lr=0.2,seed=0"  # the same last part: the whole keys
    assert points[1].group == points[0].group != points[2].group
    assert point_tags(points[3], "s") == {
        "atrlhf.sweep_id": "s",
        "atrlhf.sweep_role": "child",
        "atrlhf.sweep_point": "algorithm.loss=grpo,runtime.max_staleness=4,seed=8",
        "algorithm.loss": "grpo",
        "runtime.max_staleness": "4",
        "trainer.seed": "8",
    }
    for bad in ({"trainer.seed": [1, 2]}, {"algorithm.loss": []}, {"a..b": [1]}, ["algorithm.loss"]):
        with pytest.raises(ConfigError):
            check_grid(bad)
    for bad in (0, [], [1.5], True):
        with pytest.raises(ConfigError, match="seeds"):
            seed_list(base, bad)


def test_repeated_seeds_or_grid_values_are_refused(tmp_path, capsys):
    """Two points with one name would share one directory and one MLflow point: refused, naming what repeats."""
    base = load_config(None, ["trainer.seed=7"])
    with pytest.raises(ConfigError, match=r"sweep seeds: 1 listed more than once in \[1, 2, 1\]"):
        seed_list(base, [1, 2, 1])
    with pytest.raises(ConfigError, match=r"runtime.max_staleness lists 4 more than once"):
        check_grid({"runtime.max_staleness": [1, 4, 4]})
    with pytest.raises(ConfigError, match=r"runtime.max_staleness lists 4 more than once"):
        check_grid({"runtime.max_staleness": [4, "4"]})  # the same text: one name
    with pytest.raises(ConfigError, match="would share one name or directory"):
        expand_grid({"data.path": ["a/b.jsonl", "a_b.jsonl"]}, [0])  # one directory name
    with pytest.raises(ConfigError, match="would share one name or directory"):
        expand_grid({"algorithm.loss": ["grpo"]}, [3, 3])
    assert len(expand_grid(check_grid({"runtime.max_staleness": [1, 4]}), seed_list(base, [1, 2]))) == 4
    # the command line refuses before starting anything; a deployment's parameters at deploy time
    assert main(["sweep", "--grid", "runtime.max_staleness=1,4,1"]) == 2
    assert "runtime.max_staleness lists 1 more than once" in capsys.readouterr().err
    spec = tmp_path / "dup.yaml"
    spec.write_text("config_file: configs/staleness_sweep.yaml\ngrid: {algorithm.loss: grpo}\nseeds: [0, 0]\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: sweep seeds: 0 listed more than once"):
        load_sweep_parameters(str(spec))


def test_sweep_id_is_a_hash_of_base_grid_and_seeds():
    base = TrainConfig()
    grid = {"algorithm.loss": ["grpo", "m2po"]}
    assert sweep_id(base, grid, [0, 1]) == sweep_id(TrainConfig(), {"algorithm.loss": ["grpo", "m2po"]}, [0, 1])
    assert sweep_id(base, grid, [0, 1]) != sweep_id(base, grid, [0])
    assert sweep_id(base, grid, [0]) != sweep_id(base, {"algorithm.loss": ["grpo"]}, [0])
    assert sweep_id(base, grid, [0]) != sweep_id(load_config(None, ["trainer.lr=0.0001"]), grid, [0])


def test_a_point_config_has_its_own_dir_and_seed_and_is_validated_by_the_child():
    base = load_config(None, ["run.output_dir=/tmp/out"])
    good, bad = expand_grid({"algorithm.loss": ["m2po", "nosuch"]}, [3])
    data = point_config(base, good, "sweep-x")
    cfg = validate_config(data)
    assert cfg.algorithm.loss == "m2po" and cfg.trainer.seed == 3
    assert cfg.run.output_dir == "/tmp/out/sweep-x/algorithm.loss-m2po_seed-3"
    assert cfg.tracking.run_name == "loss=m2po,seed=3 (sweep-x)"
    data = point_config(base, bad, "sweep-x")  # not validated here: only its child fails
    with pytest.raises(ConfigError, match="algorithm.loss"):
        validate_config(data)
    (not_a_section,) = expand_grid({"trainer.lr.x": [1]}, [0])
    with pytest.raises(ConfigError, match="not a section"):
        point_config(base, not_a_section, "sweep-x")


def test_a_grid_key_spelled_the_old_way_still_sets_each_point():
    """A grid value is `--set key=value` after the base config: spelled the old way, it still wins over the base's
    value under the new spelling (which a loaded base always uses)."""
    base = load_config(None, ["run.output_dir=/tmp/out", "trainer.warm_start.steps=300"])
    points = expand_grid({"trainer.warm_start_steps": [0, 7]}, [0])
    assert [validate_config(point_config(base, p, "s")).trainer.warm_start.steps for p in points] == [0, 7]
    checked = check_points(base, {"trainer.warm_start_steps": [0, 7]}, [0])
    assert [c.trainer.warm_start.steps for c in checked] == [0, 7]


def _child(values, seed, accuracies, status="FINISHED", error=""):
    point = SweepPoint(tuple(values.items()), seed)
    start = 1_000_000
    return ChildHistory(
        point,
        status,
        error=error,
        run_id="r" * 32,
        start_ms=start,
        histories={
            "eval/accuracy": [(s, a, start + 1000 * s) for s, a in accuracies],
            "async/staleness_mean": [(1, 0.5, 0), (2, 1.5, 0)],
            "throughput/samples_per_s": [(1, 100.0, 0), (2, 300.0, 0)],
        },
    )


def test_comparison_row_table_and_plot():
    children = [
        _child({"runtime.max_staleness": 1}, 0, [(0, 0.0), (10, 0.92), (20, 0.9)]),
        _child({"runtime.max_staleness": 1}, 1, [(0, 0.0), (10, 0.5), (20, 0.8)]),
        _child({"runtime.max_staleness": 4}, 0, [], status="FAILED", error="ConfigError: bad | value"),
    ]
    rows = [comparison_row(c, target=0.9) for c in children]
    assert rows[0]["final eval/accuracy"] == 0.9 and rows[0]["best eval/accuracy"] == 0.92
    assert rows[0]["time to target (s)"] == 10.0  # the first evaluation >= 0.9: step 10, 10 s after the start
    assert rows[1]["time to target (s)"] is None
    assert rows[0]["mean staleness"] == 1.0 and rows[0]["samples/s"] == 200.0 and rows[0]["steps"] == 20
    assert rows[2]["status"] == "FAILED" and rows[2]["final eval/accuracy"] is None
    md = table_markdown(rows, 0.9)
    assert md.splitlines()[0].startswith("| runtime.max_staleness | trainer.seed | final eval/accuracy")
    assert "time to acc ≥ 0.9 (s)" in md and "bad \\| value" in md and len(md.splitlines()) == 5
    assert md.count("| not reached |") == 2  # rows 1 and 2 never reached 0.9
    shown = display_rows(rows)  # the Prefect table: rounded, and "not reached" rather than an empty cell
    assert shown[1]["time to target (s)"] == "not reached" and shown[0]["time to target (s)"] == 10.0
    assert display_rows([{**rows[0], "samples/s": 123.456789, "mean staleness": 1 / 3}])[0]["samples/s"] == 123.0
    assert display_rows([{**rows[0], "mean staleness": 1 / 3}])[0]["mean staleness"] == 0.333
    csv_text = table_csv(rows)
    assert csv_text.splitlines()[0].startswith("point,runtime.max_staleness,trainer.seed,")
    png = comparison_plot(children, "eval/accuracy")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert comparison_plot(children, "no/such_metric") is None


def test_the_sweep_deployment_parameters(tmp_path):
    params = load_sweep_parameters("deployments/staleness_sweep.yaml")
    assert params["grid"] == {"algorithm.loss": ["grpo", "m2po"], "runtime.max_staleness": [1, 4]}
    assert params["seeds"] == 2 and params["max_parallel"] == 1
    assert validate_config(params["base_config"]).runtime.max_staleness == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("config_file: configs/staleness_sweep.yaml\ngrid: {algorithm.loss: []}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: grid.algorithm.loss"):
        load_sweep_parameters(str(bad))
    bad.write_text("config_file: configs/staleness_sweep.yaml\ngrid: {algorithm.loss: grpo,m2po}\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['seed'\]"):
        load_sweep_parameters(str(bad))


def test_the_mlflow_parent_is_reopened_and_knows_the_finished_points(tmp_path, mlflow_db):
    """No training: the parent run, children made as a training run makes them (MlflowTracker.start with the
    parent and the point's tags), a failed point recorded by the sweep, and a second attempt."""
    from tracking import MlflowTracker
    from tracking.sweep_record import SweepRecord

    base = load_config(
        None, [f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.log_system_metrics=false"]
    )
    done, failed, bad = expand_grid({"runtime.max_staleness": [1, 4, "x"]}, [0])
    record = SweepRecord(base, "sweep-t")
    parent = record.open({"grid.runtime.max_staleness": [1, 4, "x"], "seeds": [0]}, "flow-1")
    assert not record.resumed
    for point, status in ((done, "FINISHED"), (failed, "FAILED")):
        child = MlflowTracker.start(
            validate_config(point_config(base, point, "sweep-t")),
            tags=point_tags(point, "sweep-t"),
            parent_run_id=parent,
        )
        child.log_metrics([{"step": 5, "eval/accuracy": 0.5}])
        child.end(status)
    record.record_failed_point(bad, "ConfigError: runtime.max_staleness", "flow-2")
    assert record.finished_points() == {done.name: record.child_of(done).info.run_id}
    assert record.child_of(bad).data.tags["error"] == "ConfigError: runtime.max_staleness"
    row = comparison_row(read_child(record, done, "eval/accuracy"), 0.9)
    assert row["final eval/accuracy"] == 0.5 and row["status"] == "FINISHED" and row["runtime.max_staleness"] == 1
    record.end(failed=2, skipped=0, total=3)

    again = SweepRecord(base, "sweep-t")
    assert again.open({}, "flow-3") == parent and again.resumed
    assert set(again.finished_points()) == {done.name}
    run = again.client.get_run(parent)
    assert run.info.status == "RUNNING" and run.data.params["grid.runtime.max_staleness"] == '[1, 4, "x"]'
    assert run.data.tags["prefect.flow_run_id"] == "flow-3" and run.data.tags["atrlhf.sweep_failed_points"] == "2"
    assert SweepRecord(base, "sweep-other").open({}, "") != parent


# ------------------------------------------------------------------------------------------ end to end
def _sweep_runs(db):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("asynctensorrlhf")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`atrlhf.sweep_role` = 'parent'")
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    return client, parent, children


@pytest.mark.slow
def test_cli_sweep_reports_a_bad_point_and_a_rerun_skips_the_finished(prefect_api, tmp_path, mlflow_db, capsys):
    """2 x 2 x 1 seed, two points whose responses cannot fit the tiny model's context (a failure only the run
    finds: every value is valid, so the sweep starts): the two good points finish (two at once, on the one Ray
    the sweep starts), the bad ones fail alone and are reported; the MLflow parent shows four children with
    the varied keys as params and tags, and the comparison artifacts; a rerun skips the two finished."""
    db = tmp_path / "mlflow.db"
    argv = [
        "sweep",
        "--set",
        *SMALL,
        f"run.output_dir={tmp_path / 'runs'}",
        f"tracking.tracking_uri=sqlite:///{db}",
        "--grid",
        "rollout.max_new_tokens=4,200",
        "--grid",
        "runtime.max_staleness=1,4",
        "--max-parallel",
        "2",
    ]
    assert main(argv) == 1, "a failed point makes the command exit 1"
    out, err = capsys.readouterr()
    assert "4 point(s), 4 ran, 0 skipped (finished before), 2 failed" in out
    assert "(Failed, in " in out, "the sweep's flow run ends Failed when a point failed"
    assert "point rollout.max_new_tokens=200,runtime.max_staleness=1,seed=0 failed" in err
    assert "rollout.max_new_tokens=200" in err and "context" in err and "Traceback" not in err

    assert "| not reached |" in out  # the failed points' time to target
    client, parent, children = _sweep_runs(db)
    sid = parent.data.tags["atrlhf.sweep_id"]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as pc:  # the sweep's flow run names its MLflow parent run
        flow_run = pc.read_flow_run(re.search(r"Prefect flow run\s+(\S+)", out).group(1))
    assert f"mlflow-run:{parent.info.run_id}" in flow_run.tags
    assert parent.info.status == "FAILED" and parent.data.tags["atrlhf.sweep_failed_points"] == "2"
    assert parent.data.params["grid.rollout.max_new_tokens"] == "[4, 200]"
    assert parent.data.params["grid.runtime.max_staleness"] == "[1, 4]"
    assert len(children) == 4
    by_point = {c.data.tags["atrlhf.sweep_point"]: c for c in children}
    for staleness in (1, 4):
        good = by_point[f"rollout.max_new_tokens=4,runtime.max_staleness={staleness},seed=0"]
        assert good.info.status == "FINISHED" and good.data.tags["atrlhf.sweep_id"] == sid
        assert good.data.params["runtime.max_staleness"] == good.data.tags["runtime.max_staleness"] == str(staleness)
        assert good.data.params["rollout.max_new_tokens"] == good.data.tags["rollout.max_new_tokens"] == "4"
        # what differs between children by construction is no param the compare view would group by
        assert not {"run.name", "run.output_dir", "tracking.run_name"} & set(good.data.params)
        assert good.data.tags["run.output_dir"].endswith(f"runtime.max_staleness-{staleness}_seed-0")
        assert [m.step for m in client.get_metric_history(good.info.run_id, "reward/mean")] == [1, 2, 3, 4]
        point_dir = f"rollout.max_new_tokens-4_runtime.max_staleness-{staleness}_seed-0"
        assert (tmp_path / "runs" / sid / point_dir).is_dir()
        bad = by_point[f"rollout.max_new_tokens=200,runtime.max_staleness={staleness},seed=0"]
        assert bad.info.status == "FAILED" and "rollout.max_new_tokens" in bad.data.tags["error"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
    assert {"comparison/comparison.csv", "comparison/comparison.md", "comparison/sweep_eval_accuracy.png"} <= artifacts
    csv_text = client.download_artifacts(parent.info.run_id, "comparison/comparison.csv", str(tmp_path))
    lines = open(csv_text).read().splitlines()
    assert len(lines) == 5 and sum("FINISHED" in line for line in lines) == 2

    assert main(argv) == 1  # the bad points fail again; the finished ones are not run again
    out, _ = capsys.readouterr()
    assert "4 point(s), 2 ran, 2 skipped (finished before), 2 failed" in out
    assert "(Failed, in " in out
    assert "FINISHED (done earlier)" in out
    _, parent_again, children = _sweep_runs(db)
    assert parent_again.info.run_id == parent.info.run_id
    assert sum(c.info.status == "FINISHED" for c in children) == 2 and len(children) == 6


def test_every_grid_value_and_point_is_validated_before_the_sweep_starts():
    """The sweep flow (and `atrlhf sweep` before it) validates each value as --set would, naming the --grid
    item, then each combination: a typo'd key no longer starts doomed children under a FAILED parent."""
    from rlhf_core.sweep_grid import check_points

    base = load_config(None, ["trainer.seed=3"])
    configs = check_points(base, {"algorithm.loss": ["grpo", "m2po"], "runtime.max_staleness": [1, 4]}, [3, 4])
    assert [(c.algorithm.loss, c.runtime.max_staleness, c.trainer.seed) for c in configs] == [
        ("grpo", 1, 3),
        ("grpo", 4, 3),
        ("m2po", 1, 3),
        ("m2po", 4, 3),
    ]
    with pytest.raises(ConfigError, match=r"^--grid algorithm.lose=grpo: algorithm.lose: unknown field"):
        check_points(base, {"algorithm.lose": ["grpo"]}, [0])
    with pytest.raises(ConfigError, match=r"^--grid runtime.max_staleness=-1: runtime.max_staleness: "):
        check_points(base, {"runtime.max_staleness": [1, -1]}, [0])
    with pytest.raises(ConfigError, match="not a section"):
        check_points(base, {"trainer.lr.x": [1]}, [0])
    assert "\n" not in str(pytest.raises(ConfigError, check_points, base, {"trainer.lr": [-1, 0]}, [0]).value)
