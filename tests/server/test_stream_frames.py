"""The streamed chunks the server writes from byte templates (`StreamFrames`) are the bytes the
pydantic response models give, and a request group's batches keep every output, in order."""

import asyncio

import pytest

from pagoda_engine.api.outputs import RequestOutput
from pagoda_engine.api.server.async_engine import RequestGroup
from pagoda_engine.api.server.protocol import (ChatCompletionStreamResponse, ChatStreamChoice, CompletionChoice,
                                               CompletionStreamResponse, DeltaMessage)
from pagoda_engine.api.server.sse import StreamFrames, sse_frame

TEXTS = ["", "hello", ' quote " and \\ backslash', "tab\tnew\nline\r", "\x00\x01\x1f\x7f", "é ü 中文 🦀",
         "\u2028\u2029", "</script>", "\ud7ff\ue000"]
ENDINGS = [(None, None), ("length", None), ("stop", "\n\n"), ("stop", 128001), ("abort", None)]


@pytest.mark.parametrize("request_id,model", [("cmpl-abc", "tiny"), ('odd "id" é', "models/with\\slash")])
def test_completion_frames_are_the_models_bytes(request_id, model):
    frames = StreamFrames(request_id, 1700000000, model, chat=False)
    for text in TEXTS:
        for index in (0, 3, 17):
            for finish_reason, stop_reason in ENDINGS:
                want = sse_frame(CompletionStreamResponse(
                    id=request_id, created=1700000000, model=model,
                    choices=[CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                              stop_reason=stop_reason)])).encode()
                assert frames.chunk(index, text, finish_reason, stop_reason) == want
                with_ids = CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)
                with_ids.token_ids = [7, 0, 2 ** 31 - 1]  # return_token_ids: an extra field
                assert frames.chunk(index, text, finish_reason, stop_reason, [7, 0, 2 ** 31 - 1]) == sse_frame(
                    CompletionStreamResponse(id=request_id, created=1700000000, model=model,
                                             choices=[with_ids])).encode()


@pytest.mark.parametrize("request_id,model", [("chatcmpl-abc", "tiny"), ('odd "id" é', "models/with\\slash")])
def test_chat_frames_are_the_models_bytes(request_id, model):
    frames = StreamFrames(request_id, 1700000000, model, chat=True)
    for text in TEXTS:
        for index in (0, 5):
            for finish_reason, stop_reason in ENDINGS:
                want = sse_frame(ChatCompletionStreamResponse(
                    id=request_id, created=1700000000, model=model,
                    choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=text),
                                              finish_reason=finish_reason, stop_reason=stop_reason)])).encode()
                assert frames.chunk(index, text, finish_reason, stop_reason) == want
                with_ids = ChatStreamChoice(index=index, delta=DeltaMessage(content=text), finish_reason=finish_reason,
                                            stop_reason=stop_reason)
                with_ids.token_ids = []
                assert frames.chunk(index, text, finish_reason, stop_reason, []) == sse_frame(
                    ChatCompletionStreamResponse(id=request_id, created=1700000000, model=model,
                                                 choices=[with_ids])).encode()


class _Stream:
    def __init__(self, request_id):
        self.request_id = request_id


def _output(request_id: str, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1], prompt_logprobs=None, outputs=[],
                         finished=finished)


def test_batches_hold_what_arrived_in_order_and_raise_after_it():
    async def main():
        group = RequestGroup(engine=None, output_kind=None)
        group.streams = [_Stream("a"), _Stream("b")]
        seen = []
        items = [_output("a", False), _output("b", False), _output("a", True)]
        for item in items:
            group.queue.put_nowait(item)
        batches = group.batches()
        seen.append(await anext(batches))  # everything queued so far, in one batch
        group.queue.put_nowait(_output("b", False))
        group.queue.put_nowait(ValueError("engine died"))
        seen.append(await anext(batches))  # the output before the error comes first
        with pytest.raises(ValueError, match="engine died"):
            await anext(batches)
        return seen, items

    seen, items = asyncio.run(main())
    assert seen[0] == items
    assert [o.request_id for o in seen[1]] == ["b"]


def test_batches_end_when_every_request_finished():
    async def main():
        group = RequestGroup(engine=None, output_kind=None)
        group.streams = [_Stream("a")]
        for item in (_output("a", False), _output("a", True), _output("a", False)):
            group.queue.put_nowait(item)
        return [batch async for batch in group.batches()]

    batches = asyncio.run(main())
    assert [[o.finished for o in batch] for batch in batches] == [[False, True]]  # the late output is not read
