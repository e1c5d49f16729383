"""The engine's offload to worker threads (``p2pkv.registrar.to_thread``), real threads.

Every blocking data-plane call (a post, a registration, a close) goes through it, so it
must keep ``trio.to_thread.run_sync``'s promises: the result or the very exception back,
the limiter held exactly while the thread runs, and a running thread never abandoned."""

from __future__ import annotations

import contextvars
import threading

import pytest
import trio
import trio.testing

from p2pkv.registrar import to_thread

WITHIN = 10  # seconds of Trio's clock: these tests only wait for threads that are told to go


async def test_result_and_exception_come_back_from_another_thread() -> None:
    with trio.fail_after(WITHIN):
        lim = trio.CapacityLimiter(1)
        ident = await to_thread(threading.get_ident, limiter=lim)
        assert ident != threading.get_ident()
        assert await to_thread(divmod, 17, 5, limiter=lim) == (3, 2)

        class Boom(Exception):
            pass

        def fail() -> None:
            raise Boom("from the worker")

        with pytest.raises(Boom, match="from the worker"):
            await to_thread(fail, limiter=lim)
        assert lim.borrowed_tokens == 0


async def test_the_limiter_is_held_while_the_thread_runs_and_serialises_callers() -> None:
    """With one token, a second call's function starts only after the first returned."""
    lim = trio.CapacityLimiter(1)
    token = trio.lowlevel.current_trio_token()
    first_running = trio.Event()
    release_first = threading.Event()
    order: list[str] = []

    def first() -> None:
        order.append("first starts")
        token.run_sync_soon(first_running.set)
        release_first.wait()
        order.append("first ends")

    def second() -> None:
        order.append("second starts")

    with trio.fail_after(WITHIN):
        async with trio.open_nursery() as nursery:
            try:  # a failed check must not leave the thread (never abandoned) waiting
                nursery.start_soon(lambda: to_thread(first, limiter=lim))
                await first_running.wait()
                assert lim.borrowed_tokens == 1
                nursery.start_soon(lambda: to_thread(second, limiter=lim))
                await trio.testing.wait_all_tasks_blocked()  # the second waits for the token
                assert lim.statistics().tasks_waiting == 1 and order == ["first starts"]
            finally:
                release_first.set()
        assert order == ["first starts", "first ends", "second starts"]
        assert lim.borrowed_tokens == 0


async def test_a_cancelled_caller_waits_for_its_thread_and_only_then_lets_go() -> None:
    """Never abandoned: the function runs to its end, its limiter token is released only
    then, and the caller sees Cancelled after the thread returned."""
    lim = trio.CapacityLimiter(1)
    token = trio.lowlevel.current_trio_token()
    running = trio.Event()
    go = threading.Event()
    done: list[str] = []
    after_thread: list[int] = []

    def work() -> str:
        token.run_sync_soon(running.set)
        go.wait()
        done.append("finished")
        return "result"

    async def caller(scope: trio.CancelScope) -> None:
        with scope:
            await to_thread(work, limiter=lim)
            after_thread.append(lim.borrowed_tokens)  # runs: the cancel comes at a checkpoint
            await trio.lowlevel.checkpoint()
            after_thread.append(-1)  # never: Cancelled was raised just above

    with trio.fail_after(WITHIN):
        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            try:  # as above: the thread is always let go
                nursery.start_soon(caller, scope)
                await running.wait()
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert lim.borrowed_tokens == 1 and not done  # still running, still held
            finally:
                go.set()
        assert done == ["finished"] and scope.cancelled_caught
        assert after_thread == [0] and lim.borrowed_tokens == 0


async def test_a_caller_cancelled_before_or_while_waiting_for_the_limiter_runs_nothing() -> None:
    lim = trio.CapacityLimiter(1)
    ran: list[str] = []
    with trio.fail_after(WITHIN):
        with trio.CancelScope() as scope:
            scope.cancel()
            await to_thread(ran.append, "cancelled first", limiter=lim)
        assert scope.cancelled_caught and not ran and lim.borrowed_tokens == 0

        holder = object()
        lim.acquire_on_behalf_of_nowait(holder)  # the token is taken: the caller waits
        async with trio.open_nursery() as nursery:
            waiting = trio.CancelScope()

            async def wait_then_run() -> None:
                with waiting:
                    await to_thread(ran.append, "never", limiter=lim)

            nursery.start_soon(wait_then_run)
            await trio.testing.wait_all_tasks_blocked()
            assert lim.statistics().tasks_waiting == 1
            waiting.cancel()
            await trio.testing.wait_all_tasks_blocked()
            try:
                assert lim.statistics().tasks_waiting == 0
            finally:  # inside the nursery: a caller that kept waiting now runs, and fails
                lim.release_on_behalf_of(holder)
        assert not ran and lim.borrowed_tokens == 0 and waiting.cancelled_caught


async def test_a_base_exception_from_the_worker_comes_back_and_frees_the_limiter() -> None:
    class Stop(BaseException):
        pass

    def stop() -> None:
        raise Stop("worker")

    lim = trio.CapacityLimiter(1)
    with trio.fail_after(WITHIN):
        with pytest.raises(Stop, match="worker"):
            await to_thread(stop, limiter=lim)
        assert lim.borrowed_tokens == 0


async def test_a_thread_that_cannot_start_gives_the_limiter_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_thread(*_: object, **__: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(trio.lowlevel, "start_thread_soon", no_thread)
    lim = trio.CapacityLimiter(1)
    with trio.fail_after(WITHIN), pytest.raises(RuntimeError, match="new thread"):
        await to_thread(int, limiter=lim)
    assert lim.borrowed_tokens == 0


async def test_each_call_runs_in_a_fresh_context() -> None:
    """The worker thread outlives a call: what one call set must not reach the next (the
    cache hands the second call the same idle thread)."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    lim = trio.CapacityLimiter(1)
    with trio.fail_after(WITHIN):
        assert await to_thread(var.set, "first call", limiter=lim) is not None
        assert await to_thread(var.get, limiter=lim) == "unset"
        var.set("caller")
        assert await to_thread(var.get, limiter=lim) == "unset"  # not a copy either
