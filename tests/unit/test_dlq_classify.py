"""Classification of dead letters and their failure signatures: one row per rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.dlq.classify import (
    DIED_AFTER_REPLAY,
    RULES,
    UNRECOGNISED,
    classify,
    failure_signature,
    split_reason,
)
from modelfleet.messages import PayloadRef, Task

REQUEST_ID = "9f1c2ab34d5e4f60a7b8c9d0e1f2a3b4"


def task(request_id: str = REQUEST_ID, url: str = "") -> Task:
    payload = PayloadRef("url", url=url) if url else PayloadRef("inline", b"x", size_bytes=1)
    return Task(request_id=request_id, model_id="digits", version="1", deadline_ms=2_000,
                reply_to="inbox.a", payload=payload, content_type="image/png", enqueued_ms=1_000)


@pytest.mark.parametrize(("reason", "expected_class", "expected_rule"), [
    # RabbitMQ gave up: consumers died without settling (evictions, restarts, deploys).
    ("delivery_limit", "transient", "consumer-died"),
    ("expired", "transient", "no-capacity"),
    ("maxlen", "transient", "no-capacity"),
    # The coordinator's runtime_crashed reasons, as ipc/socket_runtime.py and worker/ write them.
    ("runtime_crashed: runtime shared-0 is not ready", "transient", "runtime-not-ready"),
    ("runtime_crashed: runtime shared-1 did not start within 60.0s", "transient",
     "runtime-lifecycle"),
    ("runtime_crashed: runtime iso-big-0 exited with -9 during start-up", "transient",
     "runtime-lifecycle"),
    ("runtime_crashed: runtime shared-0 is gone: closed by coordinator", "transient",
     "runtime-lifecycle"),
    ("runtime_crashed: runtime shared-0 is gone: connection closed (IncompleteReadError)",
     "deterministic", "poison-input"),
    ("runtime_crashed: runtime shared-0 did not answer in time", "deterministic", "poison-input"),
    # What the coordinator writes after counting crash evidence (worker/coordinator.py).
    ("runtime_crashed: crashed its runtime alone on each of 4 deliveries: runtime shared-0 "
     "is gone: connection closed (IncompleteReadError)", "deterministic", "poison-input"),
    ("runtime_crashed: was on 7 runtimes that crashed, never alone on one: runtime shared-0 "
     "is gone: connection closed (IncompleteReadError)", "transient", "crash-never-alone"),
    ("runtime_crashed: runtime shared-0 is gone: connection lost: "
     "ConnectionResetError(104, 'Connection reset by peer')", "deterministic", "poison-input"),
    ("rejected", "deterministic", "rejected"),
    ("invalid_input: image has 0 pixels", "deterministic", "bad-input"),
    ("payload_too_large: payload is 99999999 bytes; the limit is 20971520", "deterministic",
     "bad-input"),
    ("unsupported_content_type: text/plain", "deterministic", "bad-input"),
    ("payload_fetch_forbidden: payload URL host 'x' resolves to non-public address 10.0.0.1",
     "deterministic", "bad-input"),
    ("model_error: handler raised ValueError('shape mismatch')", "deterministic",
     "model-broken"),
    ("model_load_failed: model 'digits' failed to load: UnpicklingError()", "deterministic",
     "model-broken"),
    ("model_too_large: needs 9 GiB, budget 2 GiB", "deterministic", "model-broken"),
    ("model_not_found: no model 'nope'", "deterministic", "model-broken"),
    ("payload_unavailable: fetching payload got HTTP 404 (expired, freed or never there)",
     "deterministic", "payload-gone"),
    ("payload_unavailable: fetching payload took longer than 10.0s", "transient", "dependency"),
    ("payload_unavailable: fetching payload got HTTP 503", "transient", "dependency"),
    ("no_capacity: payload store full", "transient", "dependency"),
    ("broker_unavailable: connection to amqp://x lost", "transient", "dependency"),
    ("deadline_exceeded: 30s passed", "transient", "dependency"),
    ("feature_store: lookup timed out after 2s", "transient", "connection-or-timeout"),
    ("upstream said: Connection refused", "transient", "connection-or-timeout"),
    ("something odd happened", "deterministic", "unrecognised"),
    ("", "deterministic", "unrecognised"),
])
def test_each_rule(reason: str, expected_class: str, expected_rule: str) -> None:
    verdict = classify(reason, task())
    assert (verdict.failure_class, verdict.rule) == (expected_class, expected_rule)


@pytest.mark.parametrize("reason", ["delivery_limit", "runtime_crashed: x is not ready",
                                    "deadline_exceeded: late"])
def test_a_task_that_dies_again_after_a_replay_is_deterministic(reason: str) -> None:
    verdict = classify(reason, task(), replayed_before=True)
    assert (verdict.failure_class, verdict.rule) == ("deterministic", "died-after-replay")


def test_every_rule_explains_itself_and_names_are_unique() -> None:
    rules = [*RULES, DIED_AFTER_REPLAY, UNRECOGNISED]
    assert all(len(rule.why) > 40 for rule in rules)
    assert len({rule.name for rule in rules}) == len(rules)


@pytest.mark.parametrize(("reason", "code", "detail"), [
    ("delivery_limit", "delivery_limit", ""),
    ("runtime_crashed: runtime a: b", "runtime_crashed", "runtime a: b"),
    ("Traceback: x", "", "Traceback: x"),
    ("  ", "", ""),
])
def test_split_reason(reason: str, code: str, detail: str) -> None:
    assert split_reason(reason) == (code, detail)


@pytest.mark.parametrize(("reason", "signature"), [
    ("delivery_limit", "delivery_limit"),
    ("", "(no reason given)"),
    ("runtime_crashed: runtime shared-3 is gone: connection closed (IncompleteReadError)",
     "runtime_crashed: runtime shared-<n> is gone: connection lost"),
    (f"model_error: request {REQUEST_ID} broke", "model_error: request <request-id> broke"),
    ("model_error: ctx 123e4567-e89b-12d3-a456-426614174000 bad",
     "model_error: ctx <id> bad"),
    ("model_error: segfault at 0x7f3a2b1c00", "model_error: segfault at <addr>"),
    ("payload_unavailable: fetching https://cdn.example.com/a/b.png?sig=abc got HTTP 503",
     "payload_unavailable: fetching <url> got HTTP <n>"),
    ("broker_error: 10.1.2.3:5672 reset", "broker_error: <ip> reset"),
    ("model_load_failed: cannot read /var/cache/models/resnet50/3/model.pt",
     "model_load_failed: cannot read <path>"),
    ("model_load_failed: FileNotFoundError(2, 'No such file', '/tmp/x/y.bin')",
     "model_load_failed: FileNotFoundError(<n>, 'No such file', '<path>')"),
    ("model_error: took 1.5s and 250ms", "model_error: took <n>s and <n>ms"),
    ("model_error: model 'resnet50' v2 and yolov8 keep their names",
     "model_error: model 'resnet50' v2 and yolov8 keep their names"),
    ("model_error: blob 3f9a0c11d2e4b5f6a7 gone", "model_error: blob <id> gone"),
    ("model_error:   many\n  spaces\tand lines", "model_error: many spaces and lines"),
])
def test_signature_normalisation(reason: str, signature: str) -> None:
    assert failure_signature(reason, task()) == signature


def test_the_same_failure_in_two_requests_has_one_signature() -> None:
    first = failure_signature(
        "runtime_crashed: runtime shared-0 is gone: connection lost: OSError(32) at "
        "0x7f00aa for 0af3c2d19e8b4c7d9a1b2c3d4e5f6a7b from 10.0.0.7:41234 "
        "reading /tmp/mf-0af3/payload.bin", task("0af3c2d19e8b4c7d9a1b2c3d4e5f6a7b"))
    second = failure_signature(
        "runtime_crashed: runtime shared-7 is gone: connection lost: OSError(32) at "
        "0x7f99bc for 11111111222233334444555566667777 from 10.0.0.9:5000 "
        "reading /tmp/mf-1111/payload.bin", task("11111111222233334444555566667777"))
    assert first == second


def test_the_task_payload_url_and_request_id_are_removed_even_when_they_look_plain() -> None:
    t = task(request_id="req-A", url="s3-bucket-object")
    assert failure_signature("payload_unavailable: s3-bucket-object for req-A", t) == \
        "payload_unavailable: <url> for <request-id>"


def test_signatures_are_bounded() -> None:
    signature = failure_signature("model_error: " + "word " * 200, task())
    assert len(signature) <= 240
    assert signature.endswith("…")


def test_docs_describe_every_rule() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "dlq.md").read_text()
    for rule in [*RULES, DIED_AFTER_REPLAY, UNRECOGNISED]:
        assert f"| `{rule.name}` |" in docs, f"docs/dlq.md misses rule {rule.name}"


def test_one_poison_input_is_one_signature_however_its_runtimes_socket_went() -> None:
    """Three identical pills: the runtime's socket closed mid-frame, was reset, or broke."""
    reasons = ["runtime_crashed: crashed its runtime alone on each of 3 deliveries: runtime "
               "shared-0 is gone: connection closed (IncompleteReadError)",
               "runtime_crashed: crashed its runtime alone on each of 3 deliveries: runtime "
               "shared-1 is gone: connection lost: ConnectionResetError(104, 'Connection "
               "reset by peer')",
               "runtime_crashed: crashed its runtime alone on each of 3 deliveries: runtime "
               "shared-0 is gone: connection lost: BrokenPipeError(32, 'Broken pipe')"]
    assert len({failure_signature(r, task()) for r in reasons}) == 1
