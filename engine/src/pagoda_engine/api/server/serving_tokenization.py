"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages to the token ids the
model would see, and token ids back to text.
"""

from __future__ import annotations

import asyncio

from pagoda_engine.api.server.errors import BadRequestError
from pagoda_engine.api.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    chat_message_dicts,
    template_tools,
)
from pagoda_engine.api.server.serving_engine import OpenAIServing
from pagoda_engine.api.tokenizer import encode_text, render_chat


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequestError("Give exactly one of `prompt` and `messages`.", param="prompt")
        self._check_num_messages(req.messages)

        def run() -> list[int]:
            if req.prompt is not None:
                return encode_text(self.tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)[0]
            text = render_chat(self.tokenizer, chat_message_dicts(req.messages), req.add_generation_prompt,
                               self.limits.chat_template, template_tools(req.tools), req.chat_template_kwargs,
                               req.continue_final_message)
            return encode_text(self.tokenizer, text, add_special_tokens=False)[0]

        ids = await asyncio.to_thread(run)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.vocab_size

        def run() -> str:
            bad = next((t for t in req.tokens if t >= vocab), None)
            if bad is not None:
                raise BadRequestError(f"Token id {bad} is outside the vocabulary [0, {vocab}).", param="tokens")
            return self.tokenizer.decode(req.tokens)

        return DetokenizeResponse(prompt=await asyncio.to_thread(run))
