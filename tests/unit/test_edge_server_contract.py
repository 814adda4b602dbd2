"""The gateway's edge (gateway/edge.py, gateway/chunked.py) extends uvicorn's h11 protocol
and h11's connection through attributes neither documents. pyproject pins both to the
series the edge was written and tested against; these tests name each attribute the
edge relies on, on live objects, so that a release that renames or drops one fails
here by name rather than as a gateway that silently stops timing out slow callers.
"""

from __future__ import annotations

import inspect
import re
from importlib.metadata import requires, version
from typing import Any

import h11
import pytest
from packaging.requirements import Requirement
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

from modelfleet.gateway.chunked import ChunkGuardedConnection
from modelfleet.gateway.edge import EdgeLimits, EdgeProtocol, edge_protocol


def pinned(distribution: str) -> Requirement:
    for line in requires("modelfleet") or []:
        requirement = Requirement(line)
        if requirement.name == distribution and not requirement.marker:
            return requirement
    raise AssertionError(f"modelfleet does not depend on {distribution}")


@pytest.mark.parametrize("distribution", ["uvicorn", "h11"])
def test_the_server_is_pinned_to_one_series_and_the_installed_one_is_in_it(
        distribution: str) -> None:
    requirement = pinned(distribution)
    uppers = [spec for spec in requirement.specifier if spec.operator == "<"]
    assert uppers, f"{requirement}: the edge needs an upper bound on {distribution}"
    assert requirement.specifier.contains(version(distribution)), (
        f"{distribution} {version(distribution)} is outside {requirement}: the edge "
        "(gateway/edge.py, gateway/chunked.py) was not written for it")


async def _app(scope: Any, receive: Any, send: Any) -> None:
    return None


async def _protocol() -> EdgeProtocol:
    config = Config(_app, lifespan="off", log_config=None)
    config.load()
    limits = EdgeLimits(header_read_timeout_s=1, body_read_timeout_s=1, max_connections=1)
    bound = edge_protocol(limits)
    return bound(config=config, server_state=ServerState(), app_state={})


async def test_uvicorns_protocol_has_what_the_edge_extends() -> None:
    protocol = await _protocol()
    # Set by H11Protocol.__init__, read or replaced by EdgeProtocol.
    for attribute in ("conn", "cycle", "connections", "loop", "config"):
        assert hasattr(protocol, attribute), f"H11Protocol.{attribute} is gone"
    assert isinstance(protocol.conn, ChunkGuardedConnection)  # the edge's replaced h11's
    assert protocol.cycle is None  # no request yet
    assert isinstance(protocol.connections, set)
    assert hasattr(protocol.config, "h11_max_incomplete_event_size")
    # The hooks the edge overrides, still called by uvicorn with these arguments.
    for hook, parameters in (("connection_made", ["self", "transport"]),
                             ("connection_lost", ["self", "exc"]),
                             ("data_received", ["self", "data"]),
                             ("handle_events", ["self"]),
                             ("on_response_complete", ["self"]),
                             ("send_400_response", ["self", "msg"])):
        theirs = getattr(H11Protocol, hook, None)
        assert theirs is not None, f"H11Protocol.{hook} is gone"
        assert list(inspect.signature(theirs).parameters) == parameters, (
            f"H11Protocol.{hook} now takes {inspect.signature(theirs)}")
    # uvicorn answers a malformed request through send_400_response: the edge's must
    # still be the one called from handle_events.
    assert "send_400_response" in inspect.getsource(H11Protocol.handle_events)


def test_a_request_cycle_has_the_flags_the_edge_sets() -> None:
    names = set(inspect.signature(RequestResponseCycle.__init__).parameters)
    assert {"scope", "conn", "transport", "flow", "message_event"} <= names, names
    source = inspect.getsource(RequestResponseCycle.__init__)
    for flag in ("response_started", "response_complete", "disconnected"):
        assert re.search(rf"self\.{flag}\s*=", source), f"RequestResponseCycle.{flag} is gone"


def test_h11s_connection_has_what_the_chunk_guard_reads() -> None:
    conn = ChunkGuardedConnection(16 * 1024, 1024)
    assert conn.their_state is h11.IDLE and conn.our_state is h11.IDLE
    assert conn.trailing_data == (b"", False)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                      b"5\r\nhel")
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.Data)
    # The chunk guard reads h11's reader's bytes left in the chunk being read.
    assert hasattr(conn, "_reader") and hasattr(conn._reader, "_bytes_in_chunk"), \
        "h11's ChunkedReader no longer keeps _bytes_in_chunk"
    assert conn._reader._bytes_in_chunk == 2

