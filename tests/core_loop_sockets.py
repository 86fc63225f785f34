"""A `CoreLoop` on in-process ZMQ sockets, for tests that drive the core as API server processes do:
one socket into the core, one out of it per client, and the loop in a thread of its own (started
by the test, once its first messages wait in the socket)."""

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import zmq

from pagoda_engine.core.process import CoreLoop
from pagoda_engine.messages import EngineCoreRequest, FromCore, make_decoder, make_encoder
from pagoda_engine.sampling_params import SamplingParams


@dataclass
class CoreLoopSockets:
    to_core: zmq.Socket  # what an API server sends the core
    clients: list[zmq.Socket]  # what each API server receives from it
    loop: CoreLoop
    thread: threading.Thread  # runs `loop.run`; not started
    encoder: object = field(default_factory=make_encoder)
    decoder: object = field(default_factory=lambda: make_decoder(FromCore))

    def send(self, message) -> None:
        self.to_core.send(self.encoder.encode(message))

    def send_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                     max_tokens: int = 16) -> None:
        """A request (greedy, `max_tokens` tokens, EOS ignored, unless `params` says otherwise)."""
        params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.send(EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params))

    def receive(self, client: int = 0, timeout_ms: int = 30_000):
        """The next message to `client` (a failed test when none comes in time)."""
        assert self.clients[client].poll(timeout_ms), "no message from the core loop"
        return self.decoder.decode(self.clients[client].recv())


@contextmanager
def core_loop_sockets(core, name: str, clients: int = 1):
    """The sockets and the loop of `core`; `name` keeps the inproc addresses apart. On leaving,
    the loop is stopped and every socket closed."""
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind(f"inproc://{name}-to-core")
    core_in.connect(f"inproc://{name}-to-core")
    core_outs, receivers = [], []
    for i in range(clients):
        receivers.append(ctx.socket(zmq.PULL))
        receivers[-1].bind(f"inproc://{name}-from-core-{i}")
        core_outs.append(ctx.socket(zmq.PUSH))
        core_outs[-1].connect(f"inproc://{name}-from-core-{i}")
    loop = CoreLoop(core, core_in, core_outs, parent_pid=None)
    thread = threading.Thread(target=loop.run, daemon=True)
    try:
        yield CoreLoopSockets(to_core=to_core, clients=receivers, loop=loop, thread=thread)
    finally:
        loop.running = False
        if thread.is_alive():
            thread.join(10)
        for sock in (to_core, core_in, *core_outs, *receivers):
            sock.close(linger=0)
        ctx.term()
