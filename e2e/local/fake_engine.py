"""A small real HTTP engine for router and autoscaler tests: the engine server's wire surface (OpenAI completions
and chat with SSE streaming, /v1/models, /health, /metrics with the engine's gauge names) without
a model. Tokens are `t0 t1 ...`, one per `--token-delay` seconds, so a test knows what a stream
must contain. POST /admin lets a test make it unhealthy, fail its next requests, or report a
queue (`waiting`).

Run: python fake_engine.py --port P [--model NAME] [--token-delay S]
"""

import argparse
import asyncio
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def build(model: str, token_delay: float) -> FastAPI:
    app = FastAPI()
    st = {"healthy": True, "fail_next": 0, "fail_status": 503, "running": 0, "waiting": 0, "served": 0, "prompts": [],
          "slow_health": 0, "health_delay": 0.0}

    @app.get("/health")
    async def health():
        if st["slow_health"] > 0:  # the next `slow_health` answers come after `health_delay` seconds
            st["slow_health"] -= 1
            await asyncio.sleep(st["health_delay"])
        return PlainTextResponse("ok" if st["healthy"] else "down", status_code=200 if st["healthy"] else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE pagoda:num_requests_running gauge\n"
            f'pagoda:num_requests_running{{model_name="{model}"}} {st["running"]}\n'
            "# TYPE pagoda:num_requests_waiting gauge\n"
            f'pagoda:num_requests_waiting{{model_name="{model}"}} {st["waiting"]}\n'
            "# TYPE pagoda:kv_cache_usage_perc gauge\n"
            f'pagoda:kv_cache_usage_perc{{model_name="{model}"}} {min(1.0, st["running"] / 10)}\n')

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "fake"}]}

    @app.post("/admin")
    async def admin(request: Request):
        st.update(await request.json())
        return {k: v for k, v in st.items()}

    @app.get("/admin")
    async def admin_get():
        return {k: v for k, v in st.items()}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        st["prompts"].append(body.get("prompt") if not chat else body.get("messages"))
        if st["fail_next"] > 0:
            st["fail_next"] -= 1
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error",
                                           "param": None, "code": None}}, status_code=st["fail_status"])
        if body.get("model") not in (None, model):
            return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error",
                                           "param": "model", "code": "model_not_found"}}, status_code=404)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        delay = float(body.get("fake_token_delay", token_delay))  # per request (benchmarks)
        stamp = bool(body.get("fake_stamp", False))
        obj = "chat.completion" if chat else "text_completion"
        st["served"] += 1

        def chunk(i):
            text = f"t{i} "
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            out = {"id": "x", "object": obj + (".chunk" if chat else ""), "model": model, "choices": [choice]}
            if stamp:  # wall-clock send time, so a client on this machine can time each chunk's trip
                out["t_sent"] = time.time()
            return out

        if not body.get("stream"):
            st["running"] += 1
            try:
                await asyncio.sleep(delay * n)
            finally:
                st["running"] -= 1
            text = "".join(f"t{i} " for i in range(n))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = "length"
            return {"id": "x", "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}

        async def stream():
            st["running"] += 1
            try:
                for i in range(n):
                    await asyncio.sleep(delay)
                    yield f"data: {json.dumps(chunk(i))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                st["running"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, chat=True)

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--token-delay", type=float, default=0.005)
    a = p.parse_args()
    uvicorn.run(build(a.model, a.token_delay), host="127.0.0.1", port=a.port, log_level="warning")
