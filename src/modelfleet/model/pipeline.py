"""One request's path through a handler: preprocess, batched predict, postprocess.

``preprocess`` and ``postprocess`` run on the event loop (they may await I/O
without holding the process); ``predict`` runs on a worker thread, over a batch
gathered by ``Batcher``, never on the loop. A bad input fails its own request only:
when a batched ``predict`` raises, the batch is re-run one input at a time so its
batch mates still get answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelfleet.errors import ModelFailed, ModelfleetError, RequestRejected
from modelfleet.model.api import Model, Request
from modelfleet.oip import OIP_CONTENT_TYPE
from modelfleet.repository.manifest import Manifest

if TYPE_CHECKING:  # numpy only when a v2 request comes: isolated runtimes may lack it
    from modelfleet.model.tensors import TensorCall


def as_model_error(exc: BaseException) -> ModelfleetError:
    """Handler exceptions become modelfleet errors: InvalidInput stays 4xx, the rest 500."""
    if isinstance(exc, ModelfleetError):
        return exc
    return ModelFailed(f"handler raised {exc!r}")


@dataclass
class _Pending:
    item: Any
    future: asyncio.Future[Any]
    key: str = ""  # its request id, for the runtime's flight record
    enqueued: float = field(default_factory=time.perf_counter)


# Held around a predict on its thread, given the batch's request ids (ipc/flight.py).
Recorder = Callable[[list[str]], contextlib.AbstractContextManager[None]]


class Batcher:
    """Gathers inputs for one model into batches of at most ``max_batch_size``.

    The first input of a batch waits at most ``max_delay_s`` for company.
    """

    def __init__(self, predict: Callable[[list[Any]], list[Any]], max_batch_size: int,
                 max_delay_s: float, recorder: Recorder | None = None) -> None:
        self._predict = predict
        self._recorder = recorder
        self._max_batch_size = max_batch_size
        self._max_delay_s = max_delay_s
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._loop_task: asyncio.Task[None] | None = None
        self._predicting = asyncio.Event()  # clear while a predict runs on a thread
        self._predicting.set()

    @property
    def settings(self) -> tuple[int, float]:
        """(max_batch_size, max_delay_s) it batches with now."""
        return self._max_batch_size, self._max_delay_s

    def configure(self, max_batch_size: int, max_delay_s: float) -> None:
        """Batch with these from the next batch on (the one forming keeps its own)."""
        self._max_batch_size = max_batch_size
        self._max_delay_s = max_delay_s

    async def idle(self) -> None:
        """Wait until no predict runs (a thread outlives a caller that timed out)."""
        await self._predicting.wait()

    async def submit(self, item: Any, key: str = "") -> tuple[Any, float]:
        """Predict one input (of request ``key``); returns (output, seconds in predict)."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run(), name="batcher")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(item, future, key))
        result: tuple[Any, float] = await future
        return result

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        # Nobody may wait forever on a batch that will not run.
        closed = ModelFailed("the model was unloaded before this input was predicted")
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(closed)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.perf_counter() + self._max_delay_s
            while len(batch) < self._max_batch_size:
                remaining = deadline - time.perf_counter()
                if self._queue.empty() and remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(remaining, 0)))
                except TimeoutError:
                    break
            live = [p for p in batch if not p.future.done()]
            if live:
                await self._predict_batch(live)

    async def _predict_batch(self, batch: list[_Pending]) -> None:
        # ``idle()`` waits for the whole batch, retries one by one included: the model is
        # not moved or freed while any predict for it runs.
        self._predicting.clear()
        try:
            await self._predict_and_answer(batch)
        finally:
            self._predicting.set()

    def _recorded_predict(self, items: list[Any], keys: list[str]) -> list[Any]:
        """On the predict thread: the handler's predict, in the flight record meanwhile."""
        with (self._recorder or _unrecorded)(keys):
            return self._predict(items)

    async def _predict_and_answer(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        try:
            # Shielded: a cancelled batcher cannot stop the thread; it is waited out.
            outputs = await asyncio.shield(asyncio.to_thread(
                self._recorded_predict, [p.item for p in batch], [p.key for p in batch]))
            if not isinstance(outputs, list) or len(outputs) != len(batch):
                raise ModelFailed(
                    f"predict returned {type(outputs).__name__}"
                    f"{f' of length {len(outputs)}' if isinstance(outputs, list) else ''}; "
                    f"expected a list of {len(batch)} outputs"
                )
        except Exception as exc:
            if len(batch) > 1 and not isinstance(exc, ModelFailed):
                for single in batch:  # find the input at fault; the others still get answers
                    if not single.future.done():  # its caller may have given up meanwhile
                        await self._predict_and_answer([single])
                return
            error = as_model_error(exc)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(error)
            return
        elapsed = time.perf_counter() - started
        for p, output in zip(batch, outputs, strict=True):
            if not p.future.done():
                p.future.set_result((output, elapsed))


def _unrecorded(_: list[str]) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


async def handle_request(model: Model, batcher: Batcher, request: Request,
                         manifest: Manifest | None = None) -> tuple[Any, dict[str, float]]:
    """Run one request through the handler; returns (result, phase timings in ms).

    A v2 tensor request (``OIP_CONTENT_TYPE``) is decoded against the ``manifest``'s
    signature before ``preprocess`` and its result encoded as the v2 response
    (``model.tensors``). Raises a ``ModelfleetError``: ``RequestRejected`` for bad
    input, ``ModelFailed`` for anything else the handler raised.
    """
    timings: dict[str, float] = {}
    started = time.perf_counter()
    call: TensorCall | None = None
    try:
        if request.content_type == OIP_CONTENT_TYPE:
            from modelfleet.model.tensors import TensorCall

            call, request = TensorCall.open(request, manifest)
        item = await model.preprocess(request)
        timings["preprocess"] = (time.perf_counter() - started) * 1000
        output, predict_s = await batcher.submit(item, request.request_id)
        timings["predict"] = predict_s * 1000
        started = time.perf_counter()
        result = await model.postprocess(output, request)
        if call is not None:
            result = call.answer(result)
        timings["postprocess"] = (time.perf_counter() - started) * 1000
    except (RequestRejected, ModelFailed):
        raise
    except Exception as exc:
        raise as_model_error(exc) from exc
    return result, timings
