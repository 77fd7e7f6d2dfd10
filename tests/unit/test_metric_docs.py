"""docs/metrics.md, the Grafana dashboard and the Prometheus configuration, against distkv.observability.metrics.METRICS."""

import json
import re
from pathlib import Path

import yaml

from distkv.observability.errors import ERROR_KINDS
from distkv.observability.metrics import HISTOGRAM, METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "cluster" / "grafana" / "distkv-dashboard.json"
PROMETHEUS = ROOT / "cluster" / "prometheus" / "prometheus.yml"
# labels Ray adds to every series, and the histogram bucket bound
RAY_LABELS = {"SessionName", "NodeAddress", "Component", "Version", "WorkerId", "le"}


def doc_tables() -> list[list[list[str]]]:
    """Every table of docs/metrics.md as rows of cells, header and rule left out."""
    tables, rows = [], []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines() + [""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


def test_every_metric_is_documented_with_its_kind_and_tags():
    documented = {}
    for table in doc_tables():
        for row in table:
            if len(row) == 4 and row[0].startswith("`ray_distkv_"):
                documented[row[0].strip("`")] = (row[1], tuple(t.strip() for t in row[2].split(",")))
    expected = {m.exported: (m.kind, m.tag_keys) for m in METRICS.values()}
    assert documented == expected


def test_every_error_kind_and_tag_is_documented():
    firsts = {row[0].strip("`") for table in doc_tables() for row in table}
    assert set(ERROR_KINDS) <= firsts
    assert {tag for m in METRICS.values() for tag in m.tag_keys} <= firsts


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_queries_use_exported_names_and_their_tags():
    series = {name: metric for metric in METRICS.values() for name in metric.series}
    used = set()
    for expr in dashboard_exprs():
        names = re.findall(r"\bray_distkv_\w+", expr)
        assert names, expr
        tags = set()
        for name in names:
            assert name in series, f"{name} (in {expr!r}) is no series of distkv.observability.metrics.METRICS"
            used.add(series[name].name)
            tags |= set(series[name].tag_keys)
        labels = re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr)
        labels += [label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")]
        labels += re.findall(r"label_values\([^,]*,\s*(\w+)\)", expr)
        unknown = set(labels) - tags - RAY_LABELS
        assert not unknown, f"{expr!r} uses labels {unknown} that its metrics do not have"
        if "_bucket" in expr:
            assert all(series[n].kind == HISTOGRAM for n in names if n.endswith("_bucket"))
    assert used == set(METRICS), f"metrics on no panel: {set(METRICS) - used}"


def test_dashboard_panels_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    taken = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "replica", "node"}


def test_prometheus_scrapes_what_rays_service_discovery_file_lists():
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    assert sd["files"] == [f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
