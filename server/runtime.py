"""``dadfl.server.runtime`` — running the coordinator: the gRPC server (TLS or, explicitly, plain text) around the step loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from pathlib import Path
from typing import Callable

import grpc
import torch

from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos.channel import channel_options

from .config import ServerConfig
from .coordinator import Coordinator
from .enrol import check_tokens_file
from .links import serialize_response

log = logging.getLogger("dadfl.server")

ENDPOINT_FILE = "endpoint"  # "host:port" the server listens on, written once it does
STOP_GRACE_S = 2.0
# Python's cyclic collector runs a young pass every GC_YOUNG_THRESHOLD allocations not yet
# freed (default 700). A step holds a few such objects per site until it commits, so at the
# default the passes ran many times a step and promoted what was alive, and full passes over
# every site's state followed: about 50 µs per site and step at 256 sites, and no pass found
# garbage (what a step drops, reference counting frees). Cyclic garbage waits longer instead.
GC_YOUNG_THRESHOLD = 50_000


async def serve(
    config: ServerConfig, insecure: bool = False, on_listening: Callable[[str], None] | None = None, stop: asyncio.Event | None = None,
) -> None:
    """Listen, run the federation to its last step, stop. TLS unless ``insecure``. Once
    ``stop`` is set the coordinator stops cleanly (:meth:`Coordinator.request_stop`)."""
    credentials = None
    if insecure:
        config.require_plain_text_allowed()
    else:
        cert, key = config.require_tls()
        client_ca = config.listen.client_ca.read_bytes() if config.listen.client_ca else None
        credentials = grpc.ssl_server_credentials(
            [(key.read_bytes(), cert.read_bytes())], root_certificates=client_ca, require_client_auth=config.listen.require_client_cert
        )
    enrolled = check_tokens_file(Path(config.listen.tokens))
    log.info("%d site(s) enrolled in %s", enrolled, config.listen.tokens)
    coordinator = Coordinator(config)
    # No SO_REUSEPORT: gRPC sets it by default, so a second coordinator (or any process that
    # sets it too) could bind the same port and take some of the sites' connections.
    server = grpc.aio.server(options=[*channel_options(config.wire.chunk_bytes), ("grpc.so_reuseport", 0)])
    add_coordinator(coordinator, server)
    address = config.listen.address
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address} (listen.address): is the port taken, by another coordinator perhaps?")
    endpoint = f"{address.rsplit(':', 1)[0]}:{port}"
    await server.start()
    endpoint_file = Path(config.run_dir) / ENDPOINT_FILE
    _write_atomic(endpoint_file, endpoint)
    security = "plain text" if insecure else "mutual TLS" if config.listen.require_client_cert else "TLS"
    log.info("coordinator listening on %s (%s), run folder %s", endpoint, security, config.run_dir)
    if on_listening:
        on_listening(endpoint)
    stopper = asyncio.create_task(_stop_when_set(stop, coordinator)) if stop is not None else None
    try:
        await coordinator.run()
    finally:
        if stopper is not None:
            stopper.cancel()
        endpoint_file.unlink(missing_ok=True)
        await server.stop(STOP_GRACE_S)
        await _streams_finished(STOP_GRACE_S)


async def _streams_finished(timeout: float) -> None:
    """Wait (at most ``timeout``) for the loop's other tasks: gRPC's tasks of the streams it has just
    ended need a few more loop turns after ``server.stop`` returns. Cancelled by asyncio.run's
    cleanup instead, gRPC logs each as an unhandled CancelledError with its traceback."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout)


async def _stop_when_set(stop: asyncio.Event, coordinator: Coordinator) -> None:
    await stop.wait()
    coordinator.request_stop()


def add_coordinator(coordinator: Coordinator, server: grpc.aio.Server) -> None:
    """Register the Join stream; its responses may be bytes already serialised (``links.Encoded``),
    which is how one broadcast is serialised once for every site."""
    handler = grpc.stream_stream_rpc_method_handler(
        coordinator.Join, request_deserializer=cpb.SiteMessage.FromString, response_serializer=serialize_response
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("dadfl.v1.Coordinator", {"Join": handler}),))


def run_server(config: ServerConfig, insecure: bool = False) -> None:
    """``serve`` until the run ends; SIGTERM or a first Ctrl-C stops it cleanly
    (:class:`StoppedByOperator` once the sites are told), a second Ctrl-C at once
    (KeyboardInterrupt once the server has stopped)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    asyncio.run(_serve_until_interrupted(config, insecure))


async def _serve_until_interrupted(config: ServerConfig, insecure: bool) -> None:
    """SIGTERM (``dadfl stop``, a service manager, ``docker stop``) and a first Ctrl-C set
    ``stop``: the coordinator finishes or aborts the step under way, checkpoints and tells
    the sites (``Coordinator.request_stop``). A second Ctrl-C cancels ``serve``, which stops
    the gRPC server, which cancels the sites' streams (``serve`` lets their tasks finish)."""
    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    stop = asyncio.Event()
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        loop.remove_signal_handler(signal.SIGINT)
        main.cancel()

    def request_stop(name: str) -> None:
        if not stop.is_set():
            log.warning("%s: stopping after the step under way (checkpoint, then the sites are told); Ctrl-C again stops at once", name)
        stop.set()
        loop.add_signal_handler(signal.SIGINT, interrupt)

    loop.add_signal_handler(signal.SIGINT, request_stop, "Ctrl-C")
    loop.add_signal_handler(signal.SIGTERM, request_stop, "SIGTERM")
    try:
        await serve(config, insecure, stop=stop)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        raise KeyboardInterrupt from None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
