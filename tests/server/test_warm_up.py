"""The API process's warm-up (`api/server/warm_up.py`): before the port listens its requests go
through the app, behind the API key like a client's, and leave nothing a client could see: no
request counted, no token, no prefix-cache query."""

from pathlib import Path

import httpx

from conftest import DEFAULT_ARGS, launch, scrape

TEMPLATE = Path(__file__).resolve().parent / "templates" / "hermes_tools.jinja"
KEY = "warm-up-test-key"


def test_the_warm_up_runs_before_the_port_listens_and_leaves_no_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_API_KEY", KEY)  # the routes it warms ask for the key
    srv = launch(tmp_path, *DEFAULT_ARGS, "--chat-template", str(TEMPLATE))
    try:
        log = srv.proc.log_text()
        warm_up = next(line for line in log.splitlines() if "HTTP warm-up" in line)
        assert warm_up.endswith(": /v1/models 200, /tokenize 200, /tokenize 200, /tokenize 200, /detokenize 200")
        assert log.index("HTTP warm-up") < log.index("Uvicorn running")  # before it listens
        counted = {k: v for k, v in scrape(srv.url).items()
                   if k.startswith(("pagoda:request_success", "pagoda:prompt_tokens", "pagoda:prefix_cache_queries",
                                    "pagoda:generation_tokens"))}
        assert counted and not any(counted.values()), counted
        r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "pagoda-tiny", "prompt": "Once upon a time", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert scrape(srv.url)["pagoda:request_success_total{finished_reason=length}"] == 1
    finally:
        srv.proc.stop()
