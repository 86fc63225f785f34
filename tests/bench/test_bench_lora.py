"""`pagoda bench throughput|latency --num-loras N --lora-rank R`: random PEFT adapters on all seven
projections, written for the model's shapes and accepted by the engine's checks; every request
runs on one of them (the scheduler sees them all), and a bad value exits 2 naming the flag."""

from __future__ import annotations

import json

from pagoda_engine.bench.lora import write_random_adapters
from pagoda_engine.cli import main
from pagoda_engine.lora import TARGET_MODULES, read_adapter_config
from pagoda_engine.tiny import default_model_dir

ARGS = ["--model", "pagoda-tiny", "--load-format", "auto", "--dtype", "float32", "--num-kv-pages", "256",
        "--num-prompts", "12", "--input-len", "16", "--output-len", "4"]


def test_random_adapters_fit_the_model(tmp_path):
    model = default_model_dir()
    loras = write_random_adapters(str(model), 2, 8, str(tmp_path))
    assert [r.lora_name for r in loras] == ["lora-0", "lora-1"]
    cfg = read_adapter_config("lora-0", loras[0].lora_path, max_lora_rank=8)
    assert (cfg.rank, cfg.scaling, cfg.target_modules) == (8, 1.0, TARGET_MODULES)


def test_throughput_runs_every_request_on_a_random_adapter(tmp_path, monkeypatch):
    from pagoda_engine.core.scheduler import Scheduler

    seen: set[str | None] = set()
    add = Scheduler.add_request

    def record(self, req):
        seen.add(req.lora_name)
        return add(self, req)

    monkeypatch.setattr(Scheduler, "add_request", record)
    out = tmp_path / "t1.json"
    assert main(["bench", "throughput", *ARGS, "--num-loras", "3", "--lora-rank", "8",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["settings"]["num_loras"], result["settings"]["lora_rank"]) == (3, 8)
    assert {"lora-0", "lora-1", "lora-2"} <= seen  # 12 draws of 3 (seeded) name each; warm-up ran the base


def test_bad_values_exit_2_naming_the_flag(capsys):
    assert main(["bench", "latency", *ARGS, "--num-loras", "-1"]) == 2
    assert "--num-loras must be >= 0" in capsys.readouterr().err
    assert main(["bench", "latency", *ARGS, "--num-loras", "2", "--lora-rank", "0"]) == 2
    assert "--lora-rank must be >= 1" in capsys.readouterr().err
