"""The shipped Prometheus alert rules and Grafana dashboard (deploy/): the rules pass promtool's
check and its unit tests (Debian's `prometheus` package), and every metric the rules and the
dashboard name is one a running fleet exports, at its gateway or at its replicas."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fleet_helpers import FLEET_KEY, replicas, wait_replicas_ready

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "shoal-alerts.yml"
RULES_TEST = DEPLOY / "prometheus" / "shoal-alerts-test.yml"
DASHBOARD = DEPLOY / "grafana" / "shoal-fleet.json"
NAME = re.compile(r"shoal:[a-z0-9_:]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="no promtool (Debian's prometheus package)")


@needs_promtool
def test_the_alert_rules_pass_promtools_check_and_its_unit_tests():
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout
    units = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent, capture_output=True, text=True
    )
    assert units.returncode == 0, units.stdout + units.stderr


def exported(text: str) -> set[str]:
    """The sample names a /metrics page declares (a labelled metric with no series yet included)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def named_in_rules_and_dashboard() -> tuple[set[str], set[str]]:
    """(metric names the rules and dashboard query, names the rules record themselves)."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    exprs = [r["expr"] for r in rules]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs += [t["expr"] for p in panels for t in p["targets"]]
    return {n for e in exprs for n in NAME.findall(e)}, recorded


def test_every_metric_the_rules_and_the_dashboard_name_is_exported_by_a_running_fleet(shared_fleet):
    named, recorded = named_in_rules_and_dashboard()
    assert len(named) > 25 and recorded  # the parse found them
    wait_replicas_ready(shared_fleet, 3, api_key=FLEET_KEY)  # one a test before killed may be restarting
    pages = [httpx.get(shared_fleet.url + "/metrics", timeout=10).text]
    for r in replicas(shared_fleet, FLEET_KEY).values():
        pages.append(httpx.get(r["url"] + "/metrics", timeout=10).text)
    have = set().union(*(exported(p) for p in pages))
    missing = sorted(named - recorded - have)
    assert not missing, missing
    dashboard = json.loads(DASHBOARD.read_text())
    assert {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} == {"${datasource}"}
