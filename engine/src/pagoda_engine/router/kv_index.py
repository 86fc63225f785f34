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

import argparse
import functools
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit

import msgspec
import zmq

from pagoda_engine.kv_event_wire import END_SEQ
from pagoda_engine.router.prompt_pages import CachedTokenizer, Prompt, chain, root, token_bytes

log = logging.getLogger("pagoda.router")

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
        if parent_hash is None:  # a prompt's first page: under its adapter's root, if it has one
            adapter = event.get("lora_name")
            parent = root(adapter if isinstance(adapter, str) else None)
        else:
            parent = state.keys.get(parent_hash)
        if parent is None:
            state.skipped += 1
            return
        keys = chain(parent, b"", token_bytes(tokens), size)[0]
        for h, key in zip(hashes, keys):
            state.keys[h] = key
            self._holders[key].add(pod)

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

    def matched(self, prompt: Prompt, pods: Iterable[str], adapter: str | None = None) -> dict[str, int]:
        """For each of `pods`, how many of the prompt's leading tokens it holds (whole pages,
        consecutive from the start), under the LoRA adapter `adapter` (None: the base model)."""
        pods = list(pods)
        out = dict.fromkeys(pods, 0)
        with self._lock:
            by_size: dict[int, set[str]] = {}
            for p in pods:
                state = self._pods.get(p)
                if state is not None and state.block_size:
                    by_size.setdefault(state.block_size, set()).add(p)
        for size, alive in by_size.items():
            keys = prompt.keys(size, adapter)  # outside the lock: the subscriber's thread may apply meanwhile
            with self._lock:
                holders_of = self._holders.get
                n = 0
                for key in keys:
                    holders = holders_of(key)
                    if holders is None:
                        break
                    if not alive <= holders:
                        for p in alive - holders:
                            out[p] = n * size
                        alive = alive & holders
                        if not alive:
                            break
                    n += 1
                for p in alive:
                    out[p] = n * size
        return out

    def matched_tokens(self, tokens: Sequence[int], pods: Iterable[str], adapter: str | None = None) -> dict[str, int]:
        """`matched` for a prompt given as token ids."""
        return self.matched(Prompt.of_tokens(tokens), pods, adapter)

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

@functools.lru_cache(maxsize=4096)  # on every pick, for every pod
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


@dataclass
class PrefixSource:
    """The index, its subscriber and the tokenizer: what precise prefix routing reads."""

    index: KVIndex
    subscriber: KVEventSubscriber
    tokenizer: Any
    follow: Callable[[list[str]], None]  # the engines' URLs, as discovery sees them

    def matched(self, prompt: Prompt, endpoints: Iterable[str], adapter: str | None = None) -> dict[str, int]:
        """endpoint (`ip:port`) -> leading tokens it holds (under the LoRA adapter `adapter`). A
        pod named by its address alone (llm-d's topic kv@<pod ip>@...) holds what its ip does."""
        keys = {e: e if self.index.knows(e) else e.rpartition(":")[0] for e in endpoints}
        by_key = self.index.matched(prompt, set(keys.values()), adapter)
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


def request_prompt(tokenizer: CachedTokenizer | None, body: dict) -> Prompt | None:
    """The request's prompt as the engine tokenizes it: a completion prompt with the tokenizer's
    special tokens, a chat through the model's template (only the leading pages matter); None
    without a tokenizer or a prompt."""
    if tokenizer is None:
        return None
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.prompt(text, add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: the first prompt decides
    if isinstance(prompt, str):
        return tokenizer.prompt(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        try:
            return Prompt.of_tokens(prompt)
        except OverflowError:
            raise BadRequest("the prompt's token ids must be 64-bit integers") from None
    return None
