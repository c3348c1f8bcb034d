"""Weights from one sender (trainer rank 0) to many receivers (generation workers) over a
collective group of their own: gloo on the CPU, NCCL on GPUs, one protocol.

The group is not the trainer's data-parallel group and needs no default process group: the
sender hosts a `torch.distributed.TCPStore` (its address is what the caller publishes), and
each *generation* of the group is a `ProcessGroupGloo` / `ProcessGroupNCCL` built directly
from a `PrefixStore` of it (`g{n}/pg/`), rank 0 the sender, ranks 1..k the receivers in the
generation's roster. Built that way (torch 2.13: the classes' `(store, rank, size, timeout)`
constructors), a group can be dropped and another formed at any time, in processes that
already hold a default group (a trainer rank under FSDP) or none (a worker);
`dist.new_group` cannot do that across processes whose default groups differ.

The protocol, all of it through the store but the tensors:

    generation              n, the current generation (only increases)
    g{n}/want/{m}           receiver m asks to be in generation n
    g{n}/late/{m}           receiver m found generation n formed without it
    g{n}/roster             the members of generation n, in rank order (JSON): formed
    g{n}/send/{k}           the header of the k-th send of generation n (JSON: version,
                            token, dtype, and per bucket its numel and (name, shape, offset)s)
    g{n}/ack/{k}/{m}        receiver m holds all of send k

A send: the header, then each bucket (parameters flattened, cast to the wire dtype,
`bucket_bytes` each, a larger tensor alone) broadcast from rank 0, then the sender waits for
every member's ack. A broadcast or ack that does not come within `timeout_s`, or any error,
drops the group: the generation is bumped, the members that acked are the send's
`Delivery.acked`, and the next send forms a new generation from whoever asks (members of the
old one ask again at once; one that was stopped asks when it runs again). A receiver that
finds itself outside the formed generation says so (`late`), and the next send re-forms.

A receiver runs in a thread beside the caller's work: it joins, receives each send into a
staging buffer of its own (fresh tensors per send, so the caller may hold the previous one
while the next arrives) and keeps the newest complete one for `take()`. Nothing here decides
whether a received version may be used: the caller's source of truth does (the token).

This module knows nothing about the engine, storage, versions' meaning or models: named
tensors in, named tensors out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How often a waiting side looks at the store again (seconds).
_POLL_S = 0.05
# How often a member looks for the next send's header: the sender's first bucket waits for
# every member to notice it, so this is latency on every send (a look is one store round
# trip). torch's blocking `store.wait` would notice at once, but each of its timeouts logs
# two warnings, and a member must keep looking at the generation meanwhile.
_HEADER_POLL_S = 0.01
# A store call that does not answer within this long means the other side is gone.
_STORE_TIMEOUT_S = 30.0
# A receiver's store connection gives up sooner, connect included (torch's client retries a
# refused connect until its timeout): its thread then looks again where the sender is (a
# restarted trainer listens elsewhere) and `close()` returns within about this long. At 30 s
# a worker that reached the end of its segment while the trainer it knew was being
# replaced sat in `close()` for half a minute, which the watchdog took for a stall.
_RECEIVER_STORE_TIMEOUT_S = 5.0
# How long a receiver's probe of the sender's address may take before it counts as gone.
_PROBE_S = 1.0

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"weights travel as one of {', '.join(_DTYPES)}; got {dtype}")


def backend_for(device: str) -> str:
    """The collective backend for tensors on `device`: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.startswith("cuda") else "gloo"


def _group(store, *, rank: int, size: int, timeout_s: float, device: str):
    """One generation's process group, built from the store (no default group involved)."""
    timeout = timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _broadcast(group, tensor: torch.Tensor, *, timeout_s: float) -> None:
    work = group.broadcast([tensor], dist.BroadcastOptions())
    if not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"a broadcast did not finish within {timeout_s:g} s")


def plan_buckets(
    shapes: list[tuple[str, tuple[int, ...]]], *, element_bytes: int, bucket_bytes: int
) -> list[dict]:
    """Buckets of at most `bucket_bytes` over tensors of `shapes`, in order; a tensor larger
    than one bucket gets a bucket of its own.

    Example: shapes a (2,), b (3,) and c (10,) of 4-byte elements, 24-byte buckets ->
    [{"numel": 5, "tensors": [["a", [2], 0], ["b", [3], 2]]},
     {"numel": 10, "tensors": [["c", [10], 0]]}]
    """
    buckets: list[dict] = []
    current: dict = {"numel": 0, "tensors": []}
    for name, shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        if current["tensors"] and (current["numel"] + numel) * element_bytes > bucket_bytes:
            buckets.append(current)
            current = {"numel": 0, "tensors": []}
        current["tensors"].append([name, list(shape), current["numel"]])
        current["numel"] += numel
    if current["tensors"]:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class Delivery:
    """What one send achieved: the members that hold it (`acked`), of those in the group
    (`members`; none when no receiver asked to join)."""

    version: int
    acked: tuple[int, ...]
    members: tuple[int, ...]
    seconds: float
    bytes: int
    error: str | None = None

    @property
    def complete(self) -> bool:
        return bool(self.members) and self.error is None and set(self.acked) == set(self.members)


class Sender:
    """Rank 0 of the weight group. `members` receivers (ids 0..members-1) may join;
    `address` is where they find the store. Not thread-safe: one send at a time."""

    def __init__(
        self,
        *,
        members: int,
        timeout_s: float,
        bucket_bytes: int,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        join_s: float | None = None,
    ):
        self.members, self.timeout_s, self.bucket_bytes = members, timeout_s, bucket_bytes
        self.device, self.dtype = device, dtype
        # How long a re-formed generation waits for the members of the one before it.
        self.join_s = min(timeout_s, 10.0) if join_s is None else join_s
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=_STORE_TIMEOUT_S),
        )
        self.address = (host, self.store.port)
        self.generation = 0
        self.store.set("backend", backend_for(device))
        self.store.set("generation", "0")
        self._group = None
        self._roster: list[int] = []
        self._sends = 0  # sends of the current generation
        self._expected: set[int] = set()  # members a re-formed generation waits for

    def _wanting(self, n: int) -> list[int]:
        return [m for m in range(self.members) if self.store.check([f"g{n}/want/{m}"])]

    def _bump(self, why: str, *, expect: Iterable[int] = (), quiet: bool = False) -> None:
        """Drop the group: a new generation, which waits for `expect` (members known live).
        `quiet`: an empty generation (nobody had joined) goes without a log line."""
        if not quiet:
            log.info("weight group generation %d dropped: %s", self.generation, why)
        self._group = None
        self._expected |= set(expect)
        self._roster = []
        self.generation += 1
        self._sends = 0
        self.store.set("generation", str(self.generation))

    def _form(self) -> bool:
        """A group for this send: the current one, or a new generation of whoever asks.
        False when no receiver asks (the send is skipped)."""
        n = self.generation
        if self.store.check([f"g{n}/roster"]):  # formed (maybe empty, maybe dropped)
            late = [m for m in range(self.members) if self.store.check([f"g{n}/late/{m}"])]
            if self._group is not None and not late:
                return True
            self._bump(
                f"re-forming (asking to join: {late})",
                expect=[*late, *self._roster],
                quiet=not late and not self._roster,
            )
            n = self.generation
        deadline = time.monotonic() + (self.join_s if self._expected else 0.0)
        while not self._expected <= set(self._wanting(n)) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        roster = self._wanting(n)
        self._expected = set()
        self.store.set(f"g{n}/roster", json.dumps(roster))
        self._roster = roster
        if not roster:
            return False
        try:
            self._group = _group(
                dist.PrefixStore(f"g{n}/pg/", self.store),
                rank=0,
                size=1 + len(roster),
                timeout_s=self.timeout_s,
                device=self.device,
            )
        except Exception as e:  # noqa: BLE001 - a member gone before it connected
            self._bump(f"forming failed: {e}")
            return False
        return True

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *, token=""):
        """Broadcast `named_tensors` as `version` (with `token`, the caller's proof of which
        publication it is) to every member of the group; returns a `Delivery`. Never raises
        for a member's failure: the group is dropped and the next send re-forms it."""
        start = time.perf_counter()
        tensors = [(name, t.detach()) for name, t in named_tensors]
        if not self._form():
            return Delivery(version, (), (), time.perf_counter() - start, 0)
        n, k, roster = self.generation, self._sends, tuple(self._roster)
        element = torch.empty((), dtype=self.dtype).element_size()
        buckets = plan_buckets(
            [(name, tuple(t.shape)) for name, t in tensors],
            element_bytes=element,
            bucket_bytes=self.bucket_bytes,
        )
        header = {
            "version": version,
            "token": str(token),
            "dtype": _dtype_name(self.dtype),
            "buckets": buckets,
        }
        self.store.set(f"g{n}/send/{k}", json.dumps(header))
        self._sends += 1
        sent = 0
        error = None
        try:
            flat = iter(tensors)
            for bucket in buckets:
                buf = torch.empty(bucket["numel"], dtype=self.dtype, device=self.device)
                for _name, shape, offset in bucket["tensors"]:
                    _, t = next(flat)
                    numel = t.numel()
                    buf[offset : offset + numel].copy_(t.reshape(-1))
                    del shape
                _broadcast(self._group, buf, timeout_s=self.timeout_s)
                sent += buf.numel() * element
            # Blocks until every member's ack is there (at once, not at the next poll).
            with contextlib.suppress(dist.DistStoreError):  # timed out: said just below
                self.store.wait(
                    [f"g{n}/ack/{k}/{m}" for m in roster], timedelta(seconds=self.timeout_s)
                )
            if self._acked(n, k, roster) != roster:
                error = f"no ack within {self.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - a member died or stalled mid-send
            error = f"{type(e).__name__}: {e}"
        acked = self._acked(n, k, roster)
        if error is not None:
            # The next generation waits (join_s, once) for every member of this one: a member
            # that only lost this send asks again at once; a stopped one is left out.
            self._bump(f"send of v{version} failed ({error})", expect=roster)
        return Delivery(version, acked, roster, time.perf_counter() - start, sent, error)

    def _acked(self, n: int, k: int, roster: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(m for m in roster if self.store.check([f"g{n}/ack/{k}/{m}"]))

    def close(self) -> None:
        """Drop the group and tell receivers (a generation with no roster ever comes)."""
        try:
            self.generation += 1
            self.store.set("generation", str(self.generation))
        except Exception:  # noqa: BLE001 - closing must not mask the caller's outcome
            pass
        self._group = None


@dataclass
class Staged:
    """One received send: `named_tensors` (views into the staging buckets) of `version`."""

    version: int
    token: str
    named_tensors: list[tuple[str, torch.Tensor]]
    seconds: float  # from the header to the last bucket


@dataclass
class ReceiverStats:
    received: int = 0
    failures: int = 0
    receive_seconds: float = 0.0
    joined_generation: int | None = None
    errors: list[str] = field(default_factory=list)


class Receiver:
    """Member `member` of the weight group, in a background thread (`start`, `close`).
    `address()` says where the sender's store is now (None: nowhere yet); it is asked
    again whenever the store stops answering (a restarted sender listens elsewhere)."""

    def __init__(
        self,
        *,
        member: int,
        address: Callable[[], tuple[str, int] | None],
        timeout_s: float,
        device: str = "cpu",
    ):
        """`device`: where staging buffers live when the group runs NCCL (this member's
        GPU); over gloo they are on the CPU."""
        self.member, self.address, self.timeout_s, self.device = member, address, timeout_s, device
        self.stats = ReceiverStats()
        self._staged: Staged | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-{member}", daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; returns within about `_RECEIVER_STORE_TIMEOUT_S` but for a
        bucket under way from a sender that stopped mid-send (up to `timeout_s`)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + _RECEIVER_STORE_TIMEOUT_S)

    def peek(self) -> Staged | None:
        with self._lock:
            return self._staged

    def take(self, *, version: int, token: str) -> Staged | None:
        """The staged send of exactly `version` and `token` (then no longer staged), or None.
        A staged send older than `version` is dropped; a newer one stays."""
        with self._lock:
            staged = self._staged
            if staged is None or staged.version > version:
                return None
            self._staged = None
            if staged.version == version and staged.token == str(token):
                return staged
            return None

    # ---- the thread

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    where = self.address()
                    if where is None or not _listening(where):
                        self._stop.wait(0.5)
                        continue
                    store = dist.TCPStore(
                        where[0],
                        where[1],
                        is_master=False,
                        timeout=timedelta(seconds=_RECEIVER_STORE_TIMEOUT_S),
                    )
                self._member_of_one_generation(store)
            except Exception as e:  # noqa: BLE001 - the sender or the group went away
                self.stats.failures += 1
                self.stats.errors = [*self.stats.errors[-4:], f"{type(e).__name__}: {e}"]
                log.info("weight receiver %d: %s; joining again", self.member, e)
                store = None if not _answers(store) else store
                self._stop.wait(_POLL_S)

    def _generation_changed(self, store, n: int) -> bool:
        return int(store.get("generation")) != n

    def _member_of_one_generation(self, store) -> None:
        """Join the current generation, receive its sends until it is dropped."""
        if store.get("backend").decode() == "nccl" and not self.device.startswith("cuda"):
            # An NCCL group this member cannot join (no GPU here): it stays outside, on
            # whatever the caller falls back to, and never holds up the group's forming.
            self._wait(lambda: False)
            return
        n = int(store.get("generation"))
        if store.check([f"g{n}/roster"]):
            if self.member not in json.loads(store.get(f"g{n}/roster")):
                store.set(f"g{n}/late/{self.member}", "1")
                self._wait(lambda: self._generation_changed(store, n))
                return
        else:
            store.set(f"g{n}/want/{self.member}", "1")
            if not self._wait(
                lambda: store.check([f"g{n}/roster"]) or self._generation_changed(store, n)
            ):
                return
            if self._generation_changed(store, n) and not store.check([f"g{n}/roster"]):
                return
        roster = json.loads(store.get(f"g{n}/roster"))
        if self.member not in roster:
            return
        # NCCL needs this member's GPU; over gloo the staging buffers are on the CPU.
        device = self.device if store.get("backend").decode() == "nccl" else "cpu"
        group = _group(
            dist.PrefixStore(f"g{n}/pg/", store),
            rank=1 + roster.index(self.member),
            size=1 + len(roster),
            timeout_s=self.timeout_s,
            device=device,
        )
        self.stats.joined_generation = n
        k = 0
        while not self._stop.is_set():
            key = f"g{n}/send/{k}"
            if not self._wait(
                lambda key=key: store.check([key]) or self._generation_changed(store, n),
                poll_s=_HEADER_POLL_S,
            ):
                return
            if not store.check([key]):
                return  # generation dropped
            header = json.loads(store.get(key))
            self._receive(group, header, device=device)
            store.set(f"g{n}/ack/{k}/{self.member}", "1")
            k += 1

    def _wait(self, predicate, *, poll_s: float = _POLL_S) -> bool:
        """Poll `predicate` until true (True) or the receiver is closed (False)."""
        while not self._stop.is_set():
            if predicate():
                return True
            self._stop.wait(poll_s)
        return False

    def _receive(self, group, header: dict, *, device: str) -> None:
        start = time.perf_counter()
        dtype = _DTYPES[header["dtype"]]
        named = []
        for bucket in header["buckets"]:
            buf = torch.empty(bucket["numel"], dtype=dtype, device=device)
            _broadcast(group, buf, timeout_s=self.timeout_s)
            for name, shape, offset in bucket["tensors"]:
                numel = 1
                for d in shape:
                    numel *= int(d)
                named.append((name, buf[offset : offset + numel].view(shape)))
        took = time.perf_counter() - start
        with self._lock:
            self._staged = Staged(int(header["version"]), str(header["token"]), named, took)
        self.stats.received += 1
        self.stats.receive_seconds += took


def _listening(where: tuple[str, int]) -> bool:
    """Whether something accepts connections at `where` (a sender that is gone refuses at
    once; torch's client would retry that refusal for its whole timeout)."""
    try:
        with socket.create_connection(where, timeout=_PROBE_S):
            return True
    except OSError:
        return False


def _answers(store) -> bool:
    if store is None:
        return False
    try:
        store.get("generation")
        return True
    except Exception:  # noqa: BLE001 - a store that does not answer is gone
        return False
