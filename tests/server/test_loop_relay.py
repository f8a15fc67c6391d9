"""LoopRelay: engine-thread callbacks reach the event loop in order, one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sparkinfer_cli.server.async_engine import LoopRelay


def test_a_burst_costs_one_wake_up_and_keeps_its_order() -> None:
    loop = asyncio.new_event_loop()
    wake_ups = []
    call_soon_threadsafe = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: wake_ups.append(1) or call_soon_threadsafe(*a)
    relay, received = LoopRelay(loop), []
    burst = threading.Thread(target=lambda: [relay.call(received.append, i) for i in range(100)])
    burst.start()
    burst.join()
    assert received == [] and len(wake_ups) == 1  # the loop has not run yet
    loop.run_until_complete(asyncio.sleep(0))
    assert received == list(range(100))
    relay.call(received.append, 100)  # the next burst wakes the loop again
    loop.run_until_complete(asyncio.sleep(0))
    assert received[-1] == 100 and len(wake_ups) == 2
    loop.close()
    with pytest.raises(RuntimeError):
        relay.call(received.append, 101)
