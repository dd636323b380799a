"""The Prometheus metrics of kmesh serve and KMeshConnector -> markdown tables."""

from kmesh.reference_docs.markdown import cell


def serve_metrics_table() -> str:
    """The series of kmesh serve's GET /metrics, read from its registry after one served and
    one refused request (so every label appears)."""
    rows = ["| Metric | Type | Labels | Description |", "| --- | --- | --- | --- |"]
    for name, kind, labels, text in _serve_metrics():
        rows.append(f"| `{name}` | {kind} | {labels} | {cell(text)} |")
    return "\n".join(rows) + "\n"


def connector_metrics_table() -> str:
    """The counters KMeshConnector adds to a vLLM server's /metrics: kmesh serve's request
    counters (kmesh/stats.py), with vLLM's `model_name` and `engine` labels first."""
    from kmesh.stats import COUNTERS

    rows = ["| Metric | Type | Labels | Description |", "| --- | --- | --- | --- |"]
    for name, kind, labels, text in _serve_metrics():
        if kind == "counter" and name.removesuffix("_total") in COUNTERS:
            own = "" if labels == "—" else f", {labels}"
            rows.append(f"| `{name}` | counter | `model_name`, `engine`{own} | {cell(text)} |")
    return "\n".join(rows) + "\n"


def _serve_metrics() -> list[tuple[str, str, str, str]]:
    """(exposed name, type, labels, help) of each metric family of kmesh serve."""
    from kmesh.serve.metrics import ServeMetrics
    from kmesh.stats import EngineLoad

    idle = EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)
    metrics = ServeMetrics(lambda: idle)
    metrics.served("/v1/completions", {"prompt_tokens": 1, "recovery": {}}, 0.0)
    metrics.refused("/v1/completions", 400)
    found = []
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = [label for s in family.samples for label in s.labels if label != "le"]
        described = []
        for label in dict.fromkeys(labels):
            if label == "kind":
                kinds = [s.labels["kind"] for s in family.samples if s.name == name]
                described.append(f"`kind` ({', '.join(dict.fromkeys(kinds))})")
            else:
                described.append(f"`{label}`")
        found.append((name, family.type, ", ".join(described) or "—", family.documentation))
    return found
