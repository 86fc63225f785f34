"""Which pod holds which prompt prefix, from the pods' KV events (vLLM's wire format, `kv_events`):
what precise prefix routing reads, in `pagoda epp` and `pagoda route` alike.

Engines' block hashes are their own (Pagoda's, vLLM's, each with its seed and algorithm), so the
index keys pages by a chained hash of their token ids that it computes itself, as llm-d's
KV-cache indexer does: a `BlockStored` names the tokens of its pages and the engine hash of the
page before them, the index keeps each pod's engine hash -> its key, and a request's tokens are
cut into pages of the pod's block size and looked up in the same chain. A store whose parent the
index never saw (it joined late and the replay no longer had it) cannot be placed and is skipped.

`KVEventSubscriber` reads the events on a thread of its own, in either of the two layouts
vLLM's publisher allows:
  - per pod: one SUB socket connected to each pod's PUB (`tcp://<pod host>:<port>`, the pod's
    endpoint `tcp://*:<port>`), asking the pod's replay endpoint for what it missed when it
    joins or sees a gap in the sequence numbers;
  - central (llm-d's): one SUB socket bound here, every pod connecting its PUB to it
    (endpoint `tcp://<this service>:<port>`) with the topic `kv@<pod>@<model>`, `<pod>` its
    address (`ip` or `ip:port`), which names the pod.
Each batch is applied to the index under a lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import defaultdict
import argparse
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit

import msgspec
import numpy as np
import zmq

from pagoda_engine.kv_event_wire import END_SEQ

log = logging.getLogger("pagoda.router")

_ROOT = b"\0" * 8


def _key(parent: bytes, tokens: Sequence[int] | bytes) -> bytes:
    """A page's key: its parent's and its token ids (int64 bytes, or the ids)."""
    data = tokens if isinstance(tokens, bytes) else np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(parent + data, digest_size=8).digest()


@dataclass
class _Pod:
    block_size: int = 0
    keys: dict[Any, bytes] = field(default_factory=dict)  # engine block hash -> the index's key
    skipped: int = 0  # stores whose parent was unknown


# Field order of vLLM's events, for the older array encoding (tag first).
_ARRAY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                 "lora_name", "extra_keys", "group_idx"),
                 "BlockRemoved": ("block_hashes", "medium", "group_idx"),
                 "AllBlocksCleared": ()}


def _as_map(event: Any) -> dict | None:
    if isinstance(event, dict):
        return event
    if isinstance(event, list) and event and event[0] in _ARRAY_FIELDS:
        return {"type": event[0], **dict(zip(_ARRAY_FIELDS[event[0]], event[1:]))}
    return None


class KVIndex:
    """Page key -> the pods holding it. Thread-safe: the subscriber writes, the pickers read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}
        self._holders: dict[bytes, set[str]] = defaultdict(set)

    def apply(self, pod: str, batch: Any) -> None:
        """One decoded `KVEventBatch` (`[ts, events, data_parallel_rank]`) from `pod`. Events of
        another medium than the device's (offload tiers) or of a non-main attention group are not
        prefix hits on the device and are left out."""
        if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
            log.warning("KV events from %s: not a KVEventBatch, ignored", pod)
            return
        with self._lock:
            state = self._pods.setdefault(pod, _Pod())
            for raw in batch[1]:
                event = _as_map(raw)
                if event is None:
                    continue
                kind = event.get("type")
                if event.get("medium") not in (None, "GPU") or event.get("group_idx") not in (None, 0):
                    continue
                if kind == "BlockStored":
                    self._stored(pod, state, event)
                elif kind == "BlockRemoved":
                    for h in event.get("block_hashes") or ():
                        key = state.keys.pop(h, None)
                        if key is not None:
                            self._drop(key, pod)
                elif kind == "AllBlocksCleared":
                    self._clear(pod, state)

    def _stored(self, pod: str, state: _Pod, event: dict) -> None:
        hashes, tokens, size = event.get("block_hashes") or [], event.get("token_ids") or [], event.get("block_size")
        if not isinstance(size, int) or size <= 0 or len(tokens) != size * len(hashes):
            return
        if state.block_size != size:
            if state.block_size:  # the pod restarted with another page size: what it held is gone
                self._clear(pod, state)
            state.block_size = size
        parent_hash = event.get("parent_block_hash")
        parent = _ROOT if parent_hash is None else state.keys.get(parent_hash)
        if parent is None:
            state.skipped += 1
            return
        for i, h in enumerate(hashes):
            parent = _key(parent, tokens[i * size:(i + 1) * size])
            state.keys[h] = parent
            self._holders[parent].add(pod)

    def _drop(self, key: bytes, pod: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(pod)
            if not holders:
                del self._holders[key]

    def _clear(self, pod: str, state: _Pod) -> None:
        for key in state.keys.values():
            self._drop(key, pod)
        state.keys.clear()

    def forget(self, pod: str) -> None:
        """The pod left: its cache went with it."""
        with self._lock:
            state = self._pods.pop(pod, None)
            if state is not None:
                self._clear(pod, state)

    def block_sizes(self) -> set[int]:
        with self._lock:
            return {p.block_size for p in self._pods.values() if p.block_size}

    def matched_tokens(self, tokens: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """For each of `pods`, how many of the request's leading tokens it holds (whole pages,
        consecutive from the start)."""
        pods = list(pods)
        out = dict.fromkeys(pods, 0)
        with self._lock:
            sizes = {self._pods[p].block_size for p in pods if p in self._pods and self._pods[p].block_size}
            data = np.asarray(tokens, dtype=np.int64).tobytes() if sizes else b""
            for size in sizes:
                alive = {p for p in pods if p in self._pods and self._pods[p].block_size == size}
                parent, step = _ROOT, 8 * size
                for n in range(len(tokens) // size):
                    parent = _key(parent, data[n * step:(n + 1) * step])
                    alive &= self._holders.get(parent, set())
                    if not alive:
                        break
                    for p in alive:
                        out[p] = (n + 1) * size
        return out

    def knows(self, pod: str) -> bool:
        with self._lock:
            return pod in self._pods

    def num_keys(self, pod: str) -> int:
        with self._lock:
            state = self._pods.get(pod)
            return len(state.keys) if state else 0

    def sizes(self) -> dict[str, int]:
        """pod -> pages its events say it holds."""
        with self._lock:
            return {pod: len(state.keys) for pod, state in self._pods.items()}


class KVEventSubscriber:
    """One SUB socket per pod, read on a thread; `set_pods` follows discovery."""

    def __init__(self, index: KVIndex, topic: str = "", replay: bool = True, bind: str | None = None):
        """`bind`: the central layout's address (pods named by their topics); else per pod (`set_pods`)."""
        self.index = index
        self.topic = topic.encode()
        self.replay = replay and bind is None
        self.bind = bind
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._wanted: dict[str, tuple[str, str | None]] = {}  # pod -> (endpoint, replay endpoint)
        self._socks: dict[str, zmq.Socket] = {}
        self._next_seq: dict[str, int] = {}
        self._stop = threading.Event()
        self._decode = msgspec.msgpack.Decoder().decode
        self._central = None
        if bind is not None:  # bound here, so a taken address is the caller's error (the thread reads it after)
            self._central = self._ctx.socket(zmq.SUB)
            self._central.setsockopt(zmq.SUBSCRIBE, self.topic)
            try:
                self._central.bind(bind)
            except zmq.ZMQError as e:
                self._central.close(linger=0)
                raise OSError(f"cannot bind the KV events socket to {bind}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def set_pods(self, pods: dict[str, tuple[str, str | None]]) -> None:
        """pod -> (its PUB endpoint, its replay endpoint or None)."""
        with self._lock:
            self._wanted = dict(pods)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _sync(self, poller: zmq.Poller) -> None:
        with self._lock:
            wanted = dict(self._wanted)
        for pod in [p for p in self._socks if p not in wanted]:
            sock = self._socks.pop(pod)
            poller.unregister(sock)
            sock.close(linger=0)
            self._next_seq.pop(pod, None)
            self.index.forget(pod)
        for pod, (endpoint, _) in wanted.items():
            if pod not in self._socks:
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                sock.connect(endpoint)
                self._socks[pod] = sock
                poller.register(sock, zmq.POLLIN)
                if self.replay:
                    self._replay(pod, wanted[pod][1], 0)

    def _replay(self, pod: str, endpoint: str | None, start: int) -> None:
        """Ask the pod's replay endpoint for every batch from `start` (a short wait: the pod
        may have none yet)."""
        if endpoint is None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(1000):
                _, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    break
                self._take(pod, int.from_bytes(seq, "big"), payload, replayed=True)
        except (zmq.ZMQError, ValueError) as e:
            log.warning("KV events: replay from %s failed: %s", endpoint, e)
        finally:
            sock.close(linger=0)

    def _take(self, pod: str, seq: int, payload: bytes, replayed: bool = False) -> None:
        expected = self._next_seq.get(pod)
        if expected is not None and seq == 0 < expected:
            self.index.forget(pod)  # the engine restarted: its numbering and its cache start over
            expected = None
        if expected is not None and seq < expected:
            return  # already applied (a replay overlapping the live stream)
        if expected is not None and seq > expected and not replayed and self.replay:
            self._replay(pod, self._wanted.get(pod, (None, None))[1], expected)
            if self._next_seq.get(pod, 0) > seq:
                return
        try:
            batch = self._decode(payload)
        except msgspec.DecodeError as e:
            log.warning("KV events from %s: undecodable batch %d: %s", pod, seq, e)
            return
        self.index.apply(pod, batch)
        self._next_seq[pod] = seq + 1

    def _run(self) -> None:
        poller = zmq.Poller()
        central = self._central
        if central is not None:
            poller.register(central, zmq.POLLIN)
        while not self._stop.is_set():
            if central is None:
                self._sync(poller)
            for sock, _ in poller.poll(100):
                frames = sock.recv_multipart()
                if sock is central:
                    pod = pod_of_topic(frames[0])
                else:
                    pod = next((p for p, s in self._socks.items() if s is sock), None)
                if pod is None or len(frames) != 3 or len(frames[1]) != 8:
                    continue
                self._take(pod, int.from_bytes(frames[1], "big"), frames[2])
        for sock in [*self._socks.values(), *([central] if central is not None else [])]:
            sock.close(linger=0)


def pod_of_topic(topic: bytes) -> str | None:
    """llm-d's topic `kv@<pod>@<model>` -> `<pod>`."""
    parts = topic.decode(errors="replace").split("@")
    return parts[1] if len(parts) >= 3 and parts[0] == "kv" and parts[1] else None


# --- what `pagoda epp` and `pagoda route` share ----------------------------------------------

def endpoint_of(url: str) -> str:
    """`http://10.0.0.5:8000` -> `10.0.0.5:8000`: how the gateway names a pod, and the index too."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def add_kv_event_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="the engines' model (directory, GGUF file or pagoda-tiny): its tokenizer cuts a "
                             "request into the pages the KV events name; needs --kv-events-port or --kv-events-bind")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="precise prefix routing: each engine's KV events PUB port (its --kv-events-config "
                             "endpoint tcp://*:PORT), one socket per engine")
    parser.add_argument("--kv-events-replay-port", type=int, default=None,
                        help="each engine's KV events replay port (replay_endpoint), asked for missed batches")
    parser.add_argument("--kv-events-bind", default=None, metavar="ADDRESS",
                        help="instead of --kv-events-port: bind one SUB socket here (e.g. tcp://*:5557) that every "
                             "engine publishes to (its endpoint tcp://<this service>:5557), each with the topic "
                             "kv@<its ip or ip:port>@<model> (llm-d's layout)")
    parser.add_argument("--kv-events-topic", default="", help="the engines' KV events topic prefix (default: all)")


def check_kv_event_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the KV-event flags (a message naming the flag), or None."""
    for flag in ("kv_events_port", "kv_events_replay_port"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < 65536:
            return f"--{flag.replace('_', '-')} must be a TCP port, got {value}"
    if args.kv_events_replay_port is not None and args.kv_events_port is None:
        return "--kv-events-replay-port needs --kv-events-port"
    if args.kv_events_port is not None and args.kv_events_bind is not None:
        return "--kv-events-port (one socket per engine) and --kv-events-bind (one for all) exclude each other"
    if args.kv_events_bind is not None and not args.kv_events_bind.startswith(("tcp://", "ipc://")):
        return f"--kv-events-bind must be tcp://host:port or ipc://path, got {args.kv_events_bind!r}"
    events = args.kv_events_port is not None or args.kv_events_bind is not None
    if events != (args.model is not None):
        return ("precise prefix routing needs both --kv-events-port or --kv-events-bind (where the engines "
                "publish) and --model (the tokenizer that cuts requests into their pages)")
    return None


class CachedTokenizer:
    """The model's tokenizer with the long prompts' shared parts tokenized once.

    A prompt is cut, about every `chunk_chars` characters, before a space that follows a
    non-space and precedes a letter: where a byte-level BPE's pre-tokenizer starts a new word
    anyway, so no merge spans the cut and the pieces' ids, joined, are the whole text's. Each
    piece's ids are kept (LRU), so the tenants' shared prefixes cost a dictionary lookup and only
    the new tail is tokenized. Whether the cut is exact for this tokenizer is checked once, on a
    sample with words, numbers, punctuation, newlines and other scripts cut every few words;
    where it is not (a tokenizer that marks the text's first word, adds an end token, ...), every
    prompt is tokenized whole."""

    _SAMPLE = ("Hello world, this is 42 tests.\nLine two: ünïcode wörds and 東京 text; spaces  here "
               "and\ttabs, (brackets) [more] {braces} 'quotes' \"double\" 3.14159 end-of-line.\n") * 8

    def __init__(self, tokenizer, chunk_chars: int = 256, cache_size: int = 65536):
        self.tokenizer, self.chunk_chars, self.cache_size = tokenizer, chunk_chars, cache_size
        self._cache: OrderedDict[tuple[bool, str], list[int]] = OrderedDict()
        self.exact = False
        self.exact = self._same(self._SAMPLE, 24)

    def _whole(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _same(self, text: str, chunk_chars: int) -> bool:
        saved, self.chunk_chars = self.chunk_chars, chunk_chars
        try:
            return all(self._pieces(text, special) == self._whole(text, special) for special in (True, False))
        finally:
            self.chunk_chars = saved
            self._cache.clear()

    def _cuts(self, text: str) -> list[str]:
        pieces, start = [], 0
        while len(text) - start > 2 * self.chunk_chars:
            j = start + self.chunk_chars
            while j < len(text) - 1 and not (text[j] == " " and not text[j - 1].isspace() and text[j + 1].isalpha()):
                j += 1
            if j >= len(text) - 1:
                break
            pieces.append(text[start:j])
            start = j
        pieces.append(text[start:])
        return pieces

    def _pieces(self, text: str, special: bool) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(self._cuts(text)):
            key = (special and i == 0, piece)
            ids = self._cache.get(key)
            if ids is None:
                ids = self._whole(piece, key[0])
                self._cache[key] = ids
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            out += ids
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.exact or len(text) <= 2 * self.chunk_chars:
            return self._whole(text, add_special_tokens)
        return self._pieces(text, add_special_tokens)

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)


@dataclass
class PrefixSource:
    """The index, its subscriber and the tokenizer: what precise prefix routing reads."""

    index: KVIndex
    subscriber: KVEventSubscriber
    tokenizer: Any
    follow: Callable[[list[str]], None]  # the engines' URLs, as discovery sees them

    def matched(self, tokens: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """endpoint (`ip:port`) -> leading tokens it holds. A pod named by its address alone
        (llm-d's topic kv@<pod ip>@...) holds what its ip does."""
        keys = {e: e if self.index.knows(e) else e.rpartition(":")[0] for e in endpoints}
        by_key = self.index.matched_tokens(tokens, set(keys.values()))
        return {e: by_key.get(k, 0) for e, k in keys.items()}

    def close(self) -> None:
        self.subscriber.close()


def start_prefix_source(args: argparse.Namespace) -> PrefixSource | None:
    """From checked flags (`check_kv_event_arguments`): None without KV events."""
    if args.kv_events_port is None and args.kv_events_bind is None:
        return None
    from pagoda_engine.model_path import resolve_model_path
    from pagoda_engine.tokenizer_files import load_tokenizer

    tokenizer = CachedTokenizer(load_tokenizer(resolve_model_path(args.model)))
    if not tokenizer.exact:
        log.info("prompts are tokenized whole: cutting them is not exact for this tokenizer")
    index = KVIndex()
    if args.kv_events_bind is not None:
        subscriber = KVEventSubscriber(index, args.kv_events_topic, bind=args.kv_events_bind)
        return PrefixSource(index, subscriber, tokenizer, lambda urls: None)
    subscriber = KVEventSubscriber(index, args.kv_events_topic, replay=args.kv_events_replay_port is not None)

    def follow(urls: list[str]) -> None:
        pods = {}
        for url in urls:
            host = endpoint_of(url).rpartition(":")[0]
            replay = f"tcp://{host}:{args.kv_events_replay_port}" if args.kv_events_replay_port else None
            pods[endpoint_of(url)] = (f"tcp://{host}:{args.kv_events_port}", replay)
        subscriber.set_pods(pods)

    return PrefixSource(index, subscriber, tokenizer, follow)


class BadRequest(ValueError):
    pass


def request_tokens(tokenizer, body: dict) -> list[int]:
    """The request's token ids as the engine forms them: a completion prompt with the tokenizer's
    special tokens, a chat through the model's template (only the leading pages matter)."""
    if tokenizer is None:
        return []
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: the first prompt decides
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return []
