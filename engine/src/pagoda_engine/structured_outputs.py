"""Structured outputs: a request's `StructuredOutputsParams` → an llguidance grammar → a matcher
that says, before each token is sampled, which tokens may come next.

  API process   `check(params)`: builds the grammar and validates it (no tokenizer needed, results
                cached), so a bad schema, regex or grammar is a 400 naming the problem before the
                request is queued.
  core process  `GrammarCompiler`: compiles grammars against the model's tokenizer in a thread
                pool, off the engine's loop, with a cache keyed by (kind, spec); a request waits
                (unscheduled) until its grammar is compiled, others keep running.
                `RequestGrammar`: one request's matcher (a copy of the cached, compiled one): it
                fills its row of the step's token bitmask and consumes every sampled token.
                `fill_bitmask`: the rows of all constrained requests of a step at once, in
                llguidance's own threads.

Only the core's process holds matchers: the bitmask travels with the step's `SamplingBatch` to
whichever rank samples (the last pipeline stage), like every other per-row sampling input.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Distinct specs whose checks (API process) or compiled grammars (core) are kept.
CACHE_SIZE = 256
# Compile threads in the core: grammar construction drops the GIL, so they run beside the loop.
COMPILE_THREADS = 2
# llguidance's threads filling one step's bitmask rows in parallel (they drop the GIL too).
MASK_THREADS = min(8, os.cpu_count() or 1)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint. Raises InvalidRequestError for a spec llguidance
    cannot even read (a schema that is not an object, a GBNF grammar it cannot convert)."""
    import llguidance
    from llguidance import LLMatcher

    # Compact JSON: no whitespace between tokens unless the request lets the model choose it.
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    kind = params.kind
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(params.json, defaults=options)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid structured_outputs.{kind}: {e}", param=f"structured_outputs.{kind}") from None


class CompileCache:
    """At most `size` values keyed by (kind, spec), least recently used dropped first; each value
    made once by `make(params)`, even when several threads ask for it at once (the later ones
    wait for the first one's result, or its error)."""

    def __init__(self, make: Callable[[StructuredOutputsParams], object], size: int = CACHE_SIZE):
        self._make = make
        self._size = size
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, params: StructuredOutputsParams):
        """The value for `params` (made now if not cached); raises what `make` raised."""
        key = (params.kind, params.spec)
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                self.misses += 1
                entry = self._entries[key] = Future()
                while len(self._entries) > self._size:
                    self._entries.popitem(last=False)
            else:
                self.hits += 1
                self._entries.move_to_end(key)
        if owner:
            try:
                entry.set_result(self._make(params))
            except BaseException as e:
                entry.set_exception(e)
        return entry.result()


def _validated_grammar(params: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher

    grammar = grammar_text(params)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        kind = params.kind
        raise InvalidRequestError(f"invalid structured_outputs.{kind}: {error.strip()}",
                                  param=f"structured_outputs.{kind}")
    return grammar


_checked = CompileCache(_validated_grammar)


def check(params: StructuredOutputsParams) -> None:
    """Raise InvalidRequestError, naming the problem, if llguidance cannot compile the constraint.
    Cached by (kind, spec), so a schema every request repeats is checked once."""
    _checked.get(params)


# The grammar `GrammarCompiler.prepare` compiles and fills a mask row of once at start-up.
_PREPARE_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


class GrammarCompiler:
    """The core's compile cache and thread pool. `tokenizer_factory` builds the model's
    `llguidance.LLTokenizer` (once, in the pool: at start-up through `prepare`, else on the first
    constrained request)."""

    def __init__(self, tokenizer_factory: Callable[[], object]):
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.cache = CompileCache(self._compile)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._executor = None  # llguidance's mask threads, made on the first bitmask
        self.eos_token_ids: frozenset[int] = frozenset()  # the tokenizer's, once it is built

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                tokenizer = self._tokenizer_factory()
                self.eos_token_ids = frozenset(tokenizer.eos_tokens)
                self._tokenizer = tokenizer
            return self._tokenizer

    def prepare(self) -> Future:
        """Start building the tokenizer view, compiling a grammar and filling a mask row now, in
        a compile thread beside the rest of the start-up, so that the first constrained request a
        fresh engine serves does not wait for them (half a second for SmolLM2's 49k-token
        vocabulary on CPU, more for larger ones), as each new replica of a rollout made its first
        tool call or JSON schema request do. A failure is logged, not raised: the first constrained
        request tries again and reports it."""
        return self._pool.submit(self._prepare)

    def _prepare(self) -> None:
        import json

        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_json_schema(json.dumps(_PREPARE_SCHEMA)))
            self.fill_bitmask([_Prepared(matcher)], self.tokenizer.vocab_size)
        except Exception as e:  # noqa: BLE001 - any failure leaves the lazy path as it was
            logger.warning("structured outputs were not prepared at start-up (the first constrained request "
                           "will try again): %s", e)

    def _compile(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar_text(params))
        if matcher.is_error():
            raise InvalidRequestError(f"invalid structured_outputs.{params.kind}: {matcher.get_error()}",
                                      param=f"structured_outputs.{params.kind}")
        return matcher

    def submit(self, params: StructuredOutputsParams) -> RequestGrammar:
        """Start compiling (or take the cached grammar); the request waits until `ready`."""
        return RequestGrammar(self._pool.submit(self.cache.get, params), self)

    def fill_bitmask(self, grammars: list[RequestGrammar], vocab_size: int,
                     drafts: list[list[int]] | None = None) -> np.ndarray:
        """int32 `[len(grammars), ceil(vocab_size / 32)]`: bit t of row i set when grammar i allows
        token t next, or with `drafts` (speculative decoding's verification rows) after draft
        tokens `drafts[i]` (`RequestGrammar.mask_after`). The model's padded vocabulary tail (ids
        the tokenizer does not have) stays 0."""
        from llguidance import LLExecutor

        width = (vocab_size + 31) // 32
        tokenizer_words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = np.zeros((len(grammars), max(width, tokenizer_words)), dtype=np.int32)
        row_bytes = bitmask.shape[1] * 4
        now = [i for i in range(len(grammars)) if not drafts or not drafts[i]]
        if now:  # the rows at a grammar's own state: all at once, in llguidance's threads
            if self._executor is None:
                self._executor = LLExecutor(num_threads=MASK_THREADS)
            self._executor.unsafe_compute_mask_ptr([(grammars[i].matcher, i) for i in now], bitmask.ctypes.data,
                                                   row_bytes, len(grammars))
        for i in range(len(grammars)) if drafts else ():
            if drafts[i]:
                grammars[i].mask_after(drafts[i], bitmask.ctypes.data + i * row_bytes, row_bytes)
        bitmask = bitmask[:, :width]
        if vocab_size % 32:  # ids past the model's vocabulary (a tokenizer larger than the LM head)
            bitmask[:, -1] &= np.int32((1 << (vocab_size % 32)) - 1)
        return np.ascontiguousarray(bitmask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Prepared:
    """A compiled matcher in the shape `fill_bitmask` reads (`prepare`'s one row)."""

    def __init__(self, matcher):
        self.matcher = matcher


class RequestGrammar:
    """One request's grammar: compiling (`ready` False) until its future is done, then its own
    matcher, advanced by every token the request samples."""

    def __init__(self, compiled: Future, compiler: GrammarCompiler):
        self._compiled = compiled
        self.compiler = compiler
        self._matcher = None
        self._resume: list[int] = []  # a continuation's earlier tokens, not yet consumed

    def resume_after(self, token_ids: list[int]) -> None:
        """A continuation: the matcher must first consume these (`replay`, once compiled)."""
        self._resume = list(token_ids)

    def replay(self) -> InvalidRequestError | None:
        """Consume a continuation's earlier tokens; the error when the grammar refuses one."""
        tokens, self._resume = self._resume, []
        for i, token_id in enumerate(tokens):
            # (A token after the grammar is complete is refused too: only EOS could follow.)
            if self.matcher.is_stopped() or not self.accept(token_id):
                return InvalidRequestError(f"resume_token_ids[{i}] (token {token_id}) does not follow the "
                                           f"request's output grammar", param="resume_token_ids")
        return None

    @property
    def ready(self) -> bool:
        """Compiled without error (and a continuation's tokens replayed): the request may be scheduled."""
        return self._compiled.done() and self._compiled.exception() is None and not self._resume

    @property
    def future(self) -> Future:
        return self._compiled

    def error(self) -> InvalidRequestError | None:
        """Why the grammar could not be compiled (once its future is done), or None."""
        exc = self._compiled.exception()
        if exc is None or isinstance(exc, InvalidRequestError):
            return exc
        return InvalidRequestError(f"the grammar could not be compiled: {exc}", param="structured_outputs")

    @property
    def matcher(self):
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False when the matcher refuses it (it allows only what the
        bitmask allowed, so this means an invalid state: the request should end)."""
        matcher = self.matcher
        if token_id in self.compiler.eos_token_ids:
            return True  # EOS is sampled only where the grammar may end; it ends the request itself
        if matcher.is_stopped():
            return True
        ok = matcher.consume_token(token_id)
        if not ok:
            logger.warning("grammar refused token %d: %s", token_id, matcher.get_error())
        return ok

    def mask_after(self, draft: list[int], pointer: int, size: int) -> None:
        """Write the mask of the token after `draft` (drafted tokens the request has not kept yet:
        a verification row) to `size` bytes at `pointer`; the matcher is left as it was. Past the
        first draft token the grammar refuses (or an EOS, which would end the request), the mask
        is the one at that token: verification stops there, since the token sampled under that
        mask cannot be the refused one, so the later rows' tokens are never kept."""
        matcher = self.matcher
        valid = matcher.validate_tokens(draft) if not matcher.is_stopped() else 0
        eos = next((j for j, t in enumerate(draft[:valid]) if t in self.compiler.eos_token_ids), valid)
        valid = min(valid, eos)
        if valid and not matcher.consume_tokens(draft[:valid]):
            raise RuntimeError(f"the grammar refused draft tokens it had validated: {matcher.get_error()}")
        try:
            matcher.unsafe_compute_mask_ptr(pointer, size)
        finally:
            if valid:
                matcher.rollback(valid)

    def ended_by(self, token_id: int) -> bool:
        """Whether `token_id` is the EOS that ends a complete grammar (after it, the request stops)."""
        return token_id in self.compiler.eos_token_ids and self.matcher.is_accepting()


def fill_bitmask(grammars: list[RequestGrammar], vocab_size: int, drafts: list[list[int]] | None = None) -> np.ndarray:
    """One step's bitmask rows, one per constrained sampling row (see `GrammarCompiler.fill_bitmask`)."""
    return grammars[0].compiler.fill_bitmask(grammars, vocab_size, drafts)
