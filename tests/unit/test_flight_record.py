"""A runtime's flight record names the model whose code ran on a thread when it died."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from modelfleet.ipc.flight import Flight, FlightRecord, read_flight_record


def test_a_process_killed_in_predict_leaves_its_model_named(tmp_path: Path) -> None:
    path = tmp_path / "runtime.flight"
    # A real process, dying the way a poison pill kills a runtime: no cleanup at all.
    script = textwrap.dedent(f"""
        import os
        from modelfleet.ipc.flight import FlightRecord
        record = FlightRecord({str(path)!r})
        with record.running("iris", ["r1"]):
            pass  # finished: no longer named
        with record.running("banner"):  # a load
            with record.running("crasher", ["pill", "mate"]):  # a predict of two
                os._exit(13)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, timeout=60)
    assert done.returncode == 13
    flight = read_flight_record(str(path))
    assert flight == Flight(frozenset({"banner", "crasher"}), frozenset({"pill", "mate"}),
                            frozenset({"banner"}))
    assert flight.suspects("crasher", "pill") and flight.suspects("banner", "any")
    assert not flight.suspects("crasher", "waiting") and not flight.suspects("iris", "r1")


def test_nothing_running_names_nobody_and_no_record_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "runtime.flight"
    record = FlightRecord(str(path))
    with record.running("iris", ["r1"]):
        assert read_flight_record(str(path)) == Flight(
            frozenset({"iris"}), frozenset({"r1"}), frozenset())
    assert read_flight_record(str(path)) == Flight(frozenset(), frozenset(), frozenset())
    record.close()
    assert read_flight_record(str(tmp_path / "missing.flight")) is None
    (tmp_path / "torn.flight").write_bytes(b'["iri')
    assert read_flight_record(str(tmp_path / "torn.flight")) is None
    assert not FlightRecord(None).keeping  # an in-process runtime keeps none
