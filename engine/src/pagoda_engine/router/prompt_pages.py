"""A request's prompt as the KV-event index reads it: its token count and, for a page size, the
chained keys of its whole pages (`Prompt`), made by `CachedTokenizer` with the long prompts'
shared parts tokenized and hashed once.

A page's key is a hash of its parent's key and its token ids (int64 bytes), as llm-d's KV-cache
indexer chains them: the index (`kv_index.py`) keys the pages a pod's events name with the same
`chain`, so a request's keys find the pods holding its leading pages whatever the engines' own
block hashes are. A LoRA adapter's pages hold other K/V than the base model's for the same tokens:
their chain starts from the adapter's own root (`root`), as an event's `lora_name` says.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import OrderedDict
from typing import Sequence

ROOT = b"\0" * 8  # the parent of a prompt's first page
_ITEM = 8  # bytes of one token id
_MIN_PIECE = 16  # characters: a shorter piece costs more to keep than to tokenize


def root(adapter: str | None = None) -> bytes:
    """The parent of a prompt's first page: the base model's, or a LoRA adapter's own."""
    return ROOT if adapter is None else hashlib.blake2b(ROOT + adapter.encode(), digest_size=8).digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def chain(parent: bytes, rest: bytes, data: bytes, size: int) -> tuple[list[bytes], bytes, bytes]:
    """Continue a chain of page keys: `parent` the last whole page's key, `rest` the token bytes
    after it, `data` the next tokens' bytes. Returns the keys of the pages now whole, the last
    key and the bytes left over."""
    if rest:
        data = rest + data
    step = _ITEM * size
    whole = len(data) // step
    keys = []
    blake2b = hashlib.blake2b
    for i in range(whole):
        parent = blake2b(parent + data[i * step:(i + 1) * step], digest_size=8).digest()
        keys.append(parent)
    return keys, parent, data[whole * step:]


class _Piece:
    """A cached piece of prompt text in its context (the pieces before it): its token ids and,
    per page size, the pages it completes."""

    __slots__ = ("id", "data", "end", "runs", "after")

    def __init__(self, id_: int, data: bytes, end: int):
        self.id, self.data, self.end = id_, data, end  # end: the prompt's tokens up to this piece's last
        self.runs: dict[int, tuple[list[bytes], bytes, bytes]] = {}  # size -> chain's answer after this piece
        self.after: _Run | None = None  # a prompt's first piece: the pieces that followed it


class _Run:
    """The pieces that followed a first piece in a prompt: the prompt's text after the first piece
    (the pieces' and the uncached tail's), where each piece ends in it, and, per page size, the keys
    of the pages of the first piece and all of them."""

    __slots__ = ("text", "ends", "pieces", "keys")

    def __init__(self, text: str, ends: list[int], pieces: list[_Piece]):
        self.text, self.ends, self.pieces = text, ends, pieces
        self.keys: dict[int, list[bytes]] = {}


def _continue(keys: list[bytes], parent: bytes, rest: bytes, pieces: Sequence[_Piece],
              size: int) -> tuple[bytes, bytes]:
    """Add the keys of the pages `pieces` complete after the state (`parent`, `rest`) to `keys`."""
    for piece in pieces:
        run = piece.runs.get(size)
        if run is None:
            # A piece is cached under the pieces before it: this state is the only one it follows.
            run = piece.runs[size] = chain(parent, rest, piece.data, size)
        keys += run[0]
        parent, rest = run[1], run[2]
    return parent, rest


class Prompt:
    """A prompt's token ids as cached pieces (the first `ran` after the first one from its run)
    and an uncached tail; page keys per size on demand."""

    __slots__ = ("pieces", "tail", "num_tokens", "run", "ran")

    def __init__(self, pieces: list[_Piece], tail: bytes, run: _Run | None = None, ran: int = 0):
        self.pieces, self.tail, self.run, self.ran = pieces, tail, run, ran
        self.num_tokens = (pieces[-1].end if pieces else 0) + len(tail) // _ITEM

    @classmethod
    def of_tokens(cls, tokens: Sequence[int]) -> "Prompt":
        return cls([], token_bytes(tokens))

    def tokens(self) -> list[int]:
        out = array("q")
        for piece in self.pieces:
            out.frombytes(piece.data)
        out.frombytes(self.tail)
        return out.tolist()

    def keys(self, size: int, adapter: str | None = None) -> list[bytes]:
        """The chained keys of the prompt's whole pages of `size` tokens (under a LoRA adapter's
        root with `adapter`: not cached, as the base model's keys are)."""
        if adapter is not None:
            return chain(root(adapter), b"", token_bytes(self.tokens()), size)[0]
        keys: list[bytes] = []
        parent, rest, done = ROOT, b"", 0
        if self.ran:
            run_keys = self.run.keys.get(size)
            if run_keys is None:
                run_keys = []
                _continue(run_keys, ROOT, b"", [self.pieces[0], *self.run.pieces], size)
                self.run.keys[size] = run_keys
            last = self.pieces[self.ran]
            keys = run_keys[:last.end // size]  # the pages the first piece and the run's used part complete
            _, parent, rest = last.runs[size]
            done = self.ran + 1
        parent, rest = _continue(keys, parent, rest, self.pieces[done:], size)
        keys += chain(parent, rest, self.tail, size)[0]
        return keys


class CachedTokenizer:
    """The model's tokenizer with the long prompts' shared parts tokenized once.

    A prompt is cut, about every `chunk_chars` characters, before a space that follows a
    non-space and precedes a letter: where a byte-level BPE's pre-tokenizer starts a new word
    anyway, so no merge spans the cut and the pieces' ids, joined, are the whole text's. Each piece
    but the last (the tail) is kept (LRU) under the pieces before it, with its ids and the page
    keys it completes. A prompt's first piece remembers the run of pieces that followed it (a
    tenant's prefix): the next prompt starting with it finds the run's pieces by comparing its text
    with the run's, not by cutting it and looking each piece up, takes the run's page keys as one
    slice, and, where it leaves the run (its question), makes the shared text up to there a piece,
    so that only its own question is tokenized and hashed. Whether the cut is exact for this
    tokenizer is checked once, on a sample with words, numbers, punctuation, newlines and other
    scripts cut every few words; where it is not (a tokenizer that marks the text's first word,
    adds an end token, ...), every prompt is tokenized whole."""

    _SAMPLE = ("Hello world, this is 42 tests.\nLine two: ünïcode wörds and 東京 text; spaces  here "
               "and\ttabs, (brackets) [more] {braces} 'quotes' \"double\" 3.14159 end-of-line.\n") * 8

    def __init__(self, tokenizer, chunk_chars: int = 256, cache_size: int = 65536):
        self.tokenizer, self.chunk_chars, self.cache_size = tokenizer, chunk_chars, cache_size
        self._cache: OrderedDict[tuple[int, str], _Piece] = OrderedDict()
        # Pieces the cached first pieces' runs hold (perhaps evicted from the cache themselves):
        # counted against `cache_size` too, so the runs cannot keep more alive than it allows.
        self._held = 0
        self._lock = threading.Lock()  # `pagoda route` tokenizes on worker threads
        self._ids = itertools.count(1)
        # A fast tokenizer's Rust backend, called directly where it gives the wrapper's ids
        # (transformers' own call costs more than a short text's tokenization).
        self._backend = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and all(
                backend.encode(self._SAMPLE, add_special_tokens=special).ids == self._whole(self._SAMPLE, special)
                for special in (True, False)):
            self._backend = backend
        self.exact = False
        self.exact = self._same(self._SAMPLE, 24)

    def _whole(self, text: str, special: bool) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=special).ids
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _same(self, text: str, chunk_chars: int) -> bool:
        saved, self.chunk_chars = self.chunk_chars, chunk_chars
        try:
            return all(self._pieces(text, special).tokens() == self._whole(text, special) for special in (True, False))
        finally:
            self.chunk_chars = saved
            with self._lock:
                self._cache.clear()
                self._held = 0

    def _cut(self, text: str, j: int) -> int:
        """The first cut at or after `j`, or -1."""
        last = len(text) - 1
        while True:
            j = text.find(" ", j, last)
            if j < 0 or (not text[j - 1].isspace() and text[j + 1].isalpha()):
                return j
            j += 1

    def _piece(self, parent: int, before: int, text: str, special: bool) -> _Piece:
        """The piece `text` after the piece `parent` (the root: -1 or 0) and `before` tokens."""
        key = (parent, text)
        with self._lock:
            piece = self._cache.get(key)
            if piece is not None:
                self._cache.move_to_end(key)
                return piece
        ids = self._whole(text, special)
        piece = _Piece(next(self._ids), token_bytes(ids), before + len(ids))
        with self._lock:
            self._cache[key] = piece
            self._evict()
        return piece

    def _evict(self) -> None:
        while self._cache and len(self._cache) + self._held > self.cache_size:
            _, piece = self._cache.popitem(last=False)
            if piece.after is not None:
                self._held -= len(piece.after.pieces)
                piece.after = None

    def _remember(self, piece: _Piece, key: tuple[int, str], run: _Run) -> None:
        """`run` follows the first piece `piece`, while it is cached (as `key`)."""
        if len(run.pieces) > self.cache_size // 4:
            return  # it would push most of the cache out
        with self._lock:
            if self._cache.get(key) is not piece:
                return
            self._held += len(run.pieces) - (len(piece.after.pieces) if piece.after is not None else 0)
            piece.after = run
            self._evict()

    def _repeated(self, text: str, start: int, run: _Run) -> int:
        """How many of a run's pieces `text` repeats from `start`."""
        ends = run.ends
        if text.startswith(run.text[:ends[-1]], start):
            k = len(ends)
        else:  # the longest run of whole pieces it repeats
            lo, hi = 0, len(ends) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if text.startswith(run.text[:ends[mid - 1]], start):
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k:
            # The cuts inside the repeated text are the run's; the last is one here too if what
            # follows it is a space and a letter again (shorter runs: the run's own text follows).
            j = start + ends[k - 1]
            if not (j < len(text) - 1 and text[j] == " " and text[j + 1].isalpha()):
                k -= 1
        return k

    def _last_cut(self, text: str, start: int, following: str) -> int:
        """The last cut in what `text` shares with `following` from `start`, if it leaves a piece
        of at least `_MIN_PIECE` characters (else -1)."""
        lo = hi = min(len(following), len(text) - start)
        if not text.startswith(following[:hi], start):
            lo = 0
            while lo < hi - 1:  # the longest shared length: lo shares, hi does not
                mid = (lo + hi) // 2
                if text.startswith(following[:mid], start):
                    lo = mid
                else:
                    hi = mid
        j = min(start + lo, len(text) - 1)
        while True:
            j = text.rfind(" ", start + _MIN_PIECE, j)
            if j < 0 or (not text[j - 1].isspace() and text[j + 1].isalpha()):
                return j

    def _pieces(self, text: str, special: bool) -> Prompt:
        pieces: list[_Piece] = []
        ends: list[int] = []  # where each piece ends in `text`
        parent, start, run, ran = (-1 if special else 0), 0, None, 0
        while True:
            if len(pieces) == 1 and pieces[0].after is not None:
                # A tenant's prefix: the pieces after its first one, found by comparing the text
                # with the run remembered there rather than by cutting it and looking each piece up.
                run = pieces[0].after
                ran = self._repeated(text, start, run)
                if ran:
                    ends += [start + e for e in run.ends[:ran]]
                    pieces += run.pieces[:ran]
                    parent, start = pieces[-1].id, ends[-1]
                # Where the text leaves the run (a tenant's question after its prefix), the shared
                # text up to the last cut before that is a piece of its own: the next question
                # finds it cached, and only the question itself is tokenized.
                j = self._last_cut(text, start, run.text[run.ends[ran - 1] if ran else 0:])
                if j > 0:
                    pieces.append(self._piece(parent, pieces[-1].end, text[start:j], False))
                    ends.append(j)
                    parent, start = pieces[-1].id, j
            j = self._cut(text, start + self.chunk_chars)
            if j < 0:
                break
            # Only the first piece carries the special tokens (the root's id says whether).
            pieces.append(self._piece(parent, pieces[-1].end if pieces else 0, text[start:j], special and not pieces))
            ends.append(j)
            parent, start = pieces[-1].id, j
        # A new run is remembered where this prompt looked up more than the piece where it left
        # the run and one after it (a prefix that changed), or went further: a tenant's run stays
        # while its prompts differ in their questions, and with it the keys of its pages.
        looked_up = len(pieces) - 1 - ran
        if looked_up > 0 and (run is None or looked_up > 2 or start - ends[0] > run.ends[-1]):
            self._remember(pieces[0], (-1 if special else 0, text[:ends[0]]),
                           _Run(text[ends[0]:], [e - ends[0] for e in ends[1:]], pieces[1:]))
        return Prompt(pieces, token_bytes(self._whole(text[start:], special and not pieces)), run, ran)

    def prompt(self, text: str, add_special_tokens: bool = True) -> Prompt:
        if not self.exact or len(text) <= 2 * self.chunk_chars:
            return Prompt.of_tokens(self._whole(text, add_special_tokens))
        return self._pieces(text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.prompt(text, add_special_tokens).tokens()

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)
