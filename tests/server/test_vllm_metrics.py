"""vLLM's metric families on a real `pagoda serve`: each with vLLM's name under `pagoda:`, its
type, labels and buckets, and moving after a request; vLLM's interval definitions from the core's
stamps; and the Grafana dashboard shipped in the chart queries only series that exist, with PromQL
that a real Prometheus scraping a real engine answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from conftest import DEFAULT_ARGS, launch
from pagoda_e2e import PROMETHEUS, free_port, prom_query, prometheus_config, start_prometheus, start_router, until
from prometheus_client.parser import text_string_to_metric_families

from pagoda_engine.api.output_processor import SequenceUpdate
from pagoda_engine.api.server.metrics import SequenceTimes, ServerMetrics, buckets_1_2_5
from pagoda_engine.messages import EngineCoreEvent, EngineCoreEventType as Ev, SchedulerStats
from pagoda_operator import metrics as operator_metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "pagoda" / "dashboards" / "pagoda.json"
MAX_MODEL_LEN = int(DEFAULT_ARGS[DEFAULT_ARGS.index("--max-model-len") + 1])

LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LENGTHS = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # vLLM's 1-2-5 buckets up to max_model_len (512)

# vLLM's histograms this issue adds: name -> buckets (the +Inf bucket aside).
HISTOGRAMS = {
    "pagoda:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "pagoda:request_time_per_output_token_seconds": TPOT,
    "pagoda:request_prefill_time_seconds": LATENCY,
    "pagoda:request_decode_time_seconds": LATENCY,
    "pagoda:request_inference_time_seconds": LATENCY,
    "pagoda:request_prompt_tokens": LENGTHS,
    "pagoda:request_generation_tokens": LENGTHS,
    "pagoda:request_params_n": [1, 2, 5, 10, 20],
    "pagoda:request_params_max_tokens": LENGTHS,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = launch(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS)
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def families(server) -> dict:
    """The server's /metrics after one request of n=2 sequences, 6 tokens each."""
    response = httpx.post(f"{server.base_url}/completions", timeout=60, json={
        "model": "pagoda-tiny", "prompt": "The metrics of a real server", "n": 2, "max_tokens": 6, "min_tokens": 6,
        "temperature": 0})
    assert response.status_code == 200, response.text
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _samples(family, suffix: str) -> dict[str, float]:
    """Sample name suffix -> value summed over engines, e.g. `_count`."""
    return {s.labels.get("le", ""): s.value for s in family.samples if s.name == family.name + suffix}


@pytest.mark.parametrize("name", sorted(HISTOGRAMS))
def test_each_vllm_histogram_has_its_buckets_labels_and_counts_the_request(families, name):
    family = families[name]
    assert family.type == "histogram"
    bounds = [float(le) for le in _samples(family, "_bucket")]
    assert bounds == [float(b) for b in HISTOGRAMS[name]] + [float("inf")]
    for sample in family.samples:
        assert sample.labels["engine"] == "0" and sample.labels["model_name"]
    count = _samples(family, "_count")[""]
    # One observation per sequence (two), per request (n: one), per engine step (several).
    expected = {"pagoda:request_params_n": 1, "pagoda:iteration_tokens_total": None}.get(name, 2)
    if expected is None:
        assert count >= 6  # a prefill step and at least five decode steps
    else:
        assert count == expected


def test_the_histograms_hold_the_requests_values(families):
    def total(name):
        return _samples(families[name], "_sum")[""]

    assert total("pagoda:request_params_n") == 2
    assert total("pagoda:request_params_max_tokens") == 2 * 6
    assert total("pagoda:request_generation_tokens") == 2 * 6
    prompt_tokens = total("pagoda:request_prompt_tokens") / 2
    assert prompt_tokens >= 5
    # Every scheduled token counted once per step: both prompts' prefill (one prefix may be
    # cached for the second), and one token per sequence per decode step.
    assert prompt_tokens + 2 * 5 <= total("pagoda:iteration_tokens_total") <= 2 * prompt_tokens + 2 * 5
    assert total("pagoda:request_inference_time_seconds") == pytest.approx(
        total("pagoda:request_prefill_time_seconds") + total("pagoda:request_decode_time_seconds"))
    assert total("pagoda:request_time_per_output_token_seconds") == pytest.approx(
        total("pagoda:request_decode_time_seconds") / 5)


def test_cache_config_info_is_a_gauge_of_one_naming_the_cache(families):
    family = families["pagoda:cache_config_info"]
    assert family.type == "gauge"
    [sample] = family.samples
    assert sample.value == 1
    assert sample.labels == {"engine": "0", "block_size": "16", "enable_prefix_caching": "True",
                             "gpu_memory_utilization": "0.9", "num_gpu_blocks": "512"}


def test_an_epp_configured_for_vllm_reads_the_model_server_protocol_under_vllms_names(families):
    """GAIE's model-server protocol: the queue, running, KV-usage and cache-info gauges under
    vLLM's names, with the same type, labels and values as the `pagoda:` family beside them."""
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info"):
        ours, vllms = families[f"pagoda:{name}"], families[f"vllm:{name}"]
        assert vllms.type == ours.type == "gauge"
        assert [(s.labels, s.value) for s in vllms.samples] == [(s.labels, s.value) for s in ours.samples]
    assert not [name for name in families if name.startswith("vllm:") and name.removeprefix("vllm:") not in (
        "num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info")]


def test_no_vllm_metric_names_drops_the_copy():
    metrics = ServerMetrics("m", cache_info={"block_size": "16"}, vllm_metric_names=False)
    metrics.update_stats(0, SchedulerStats(num_waiting=3, kv_cache_usage=0.5))
    names = {family.name for family in text_string_to_metric_families(metrics.render().decode())}
    assert "pagoda:num_requests_waiting" in names and "pagoda:cache_config_info" in names
    assert not [name for name in names if name.startswith("vllm:")]
    metrics = ServerMetrics("m", cache_info={"block_size": "16"})
    metrics.update_stats(0, SchedulerStats(num_waiting=3, kv_cache_usage=0.5))
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert values["vllm:num_requests_waiting"] == 3 and values["vllm:kv_cache_usage_perc"] == 0.5


def test_no_created_series(families):
    assert not [name for name in families if name.endswith("_created")]
    assert not [s.name for f in families.values() for s in f.samples if s.name.endswith("_created")]


def test_intervals_follow_vllms_definitions_from_the_core_stamps():
    """queue = scheduled - queued, prefill = first token - scheduled (the first admission, not a
    readmission after preemption), decode = last - first token, inference = prefill + decode."""
    metrics = ServerMetrics("m", max_model_len=100)
    times = SequenceTimes(arrival_time=1000.0, num_prompt_tokens=7, max_tokens=None)
    metrics.observe(times, SequenceUpdate("r", 0, 1, None, [
        EngineCoreEvent(Ev.QUEUED, 1000.0), EngineCoreEvent(Ev.SCHEDULED, 1000.5),
        EngineCoreEvent(Ev.FIRST_TOKEN, 1001.75)]))
    metrics.observe(times, SequenceUpdate("r", 0, 1, None, [EngineCoreEvent(Ev.PREEMPTED, 1002.0),
                                                            EngineCoreEvent(Ev.SCHEDULED, 1003.0)]))
    metrics.observe(times, SequenceUpdate("r", 0, 2, "length", None))
    metrics.update_stats(0, SchedulerStats(num_scheduled_tokens=9))
    metrics.update_stats(0, SchedulerStats())  # an idle report: no step, no observation
    samples = {s.name: s.value for family in metrics.registry.collect() for s in family.samples
               if not s.labels.get("le")}
    assert samples["pagoda:request_prefill_time_seconds_sum"] == 1.25
    decode = samples["pagoda:request_decode_time_seconds_sum"]
    assert 0 <= decode < 5
    assert samples["pagoda:request_inference_time_seconds_sum"] == pytest.approx(1.25 + decode)
    assert samples["pagoda:request_time_per_output_token_seconds_sum"] == pytest.approx(decode / 3)
    assert samples["pagoda:request_generation_tokens_sum"] == 4
    # max_tokens None: up to max_model_len, as vLLM fills it in.
    assert samples["pagoda:request_params_max_tokens_sum"] == 100 - 7
    assert samples["pagoda:iteration_tokens_total_count"] == 1
    assert samples["pagoda:iteration_tokens_total_sum"] == 9
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)


# --- the Grafana dashboard ----------------------------------------------------------------------
# kube-state-metrics' series (the engine Deployment's desired and ready replicas): not on any
# Pagoda /metrics; the only names outside Pagoda the dashboard may query.
KUBE_STATE_METRICS = {"kube_deployment_spec_replicas", "kube_deployment_status_replicas_ready"}
# The operator's series (the autoscaler's decisions): checked against a real operator's /metrics
# and a real Prometheus in tests/operator/test_operator_metrics.py.
OPERATOR_METRICS = set(operator_metrics.SERIES)
_PROMQL_NON_METRICS = {"sum", "by", "rate", "avg", "max", "min", "histogram_quantile", "le", "pod", "deployment",
                       "finished_reason", "label_values", "namespace", "service", "model_name", "without",
                       "on", "ignoring", "group_left"}


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)) - _PROMQL_NON_METRICS
    return {n for n in names if not re.fullmatch(r"[0-9.]+", n)}


def test_every_metric_the_dashboard_queries_exists_on_a_real_engine_or_router(server, families, tmp_path):
    router_port = free_port()
    router = start_router(router_port, [server.url], tmp_path / "route.log")
    try:
        router_text = httpx.get(f"http://127.0.0.1:{router_port}/metrics", timeout=10).text
    finally:
        router.stop()
    exported = {s.name for f in families.values() for s in f.samples}
    exported |= {s.name for f in text_string_to_metric_families(router_text) for s in f.samples}

    dashboard = json.loads(DASHBOARD.read_text())
    queried = set().union(*map(_metric_names, _queries(dashboard)))
    assert {"pagoda:time_to_first_token_seconds_bucket", "pagoda:kv_cache_usage_perc"} <= queried  # parsed
    assert not queried - exported - KUBE_STATE_METRICS - OPERATOR_METRICS
    # Every panel the issue asks for is there, and each has a query.
    titles = {p["title"] for p in dashboard["panels"]}
    assert titles == {"Request rate", "Tokens / s", "Time to first token", "Inter-token latency",
                      "End-to-end latency", "Running / waiting", "KV-cache usage", "Prefix-cache hit rate",
                      "Preemptions", "Replicas: autoscaler desired vs actual"}
    assert all(p["targets"] for p in dashboard["panels"])


def _as_prometheus_sees_it(query: str) -> str:
    """A panel's query with Grafana's variables as the dashboard's defaults (All) leave them."""
    for variable in ("$namespace", "$service", "$model_name"):
        query = query.replace(variable, ".*")
    return query.replace("$__rate_interval", "1m")


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)")
def test_every_dashboard_query_answers_from_a_real_prometheus_scraping_a_real_engine(server, families, tmp_path):
    """Each panel's PromQL parses, and its labels (namespace, service and pod, as a ServiceMonitor
    attaches them) select series: only kube-state-metrics' and the operator's series may come back
    empty here (the operator's are proved in tests/operator/test_operator_metrics.py)."""
    port = free_port()
    labels = {"namespace": "default", "service": "svc-engine", "pod": "svc-engine-0"}
    prom = start_prometheus(port, prometheus_config({"engines": [(server.url.removeprefix("http://"), labels)]}),
                            tmp_path / "prometheus")
    base = f"http://127.0.0.1:{port}"
    try:
        # Two scrapes after the request: enough for every rate() over the window.
        def scrapes() -> float:
            return sum(float(r["value"][1]) for r in prom_query(base, "count_over_time(up[1m])"))

        until(lambda: scrapes() >= 2, timeout=30, what="two scrapes of the engine")
        dashboard = json.loads(DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                result = prom_query(base, _as_prometheus_sees_it(target["expr"]))
                if not _metric_names(target["expr"]) <= KUBE_STATE_METRICS | OPERATOR_METRICS:
                    assert result, (panel["title"], target["expr"])
                    assert {"pod"} <= result[0]["metric"].keys() or "deployment" in target["expr"], panel["title"]
        for variable in (v for v in dashboard["templating"]["list"] if v["type"] == "query"):
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
            values = {r["metric"].get(label) for r in prom_query(base, _as_prometheus_sees_it(selector))}
            assert values == {labels.get(label, families["pagoda:num_requests_running"].samples[0].labels.get(label))}
    finally:
        prom.stop()
