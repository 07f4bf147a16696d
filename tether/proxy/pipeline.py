"""tether's addons as one entry in mitmproxy's addon chain.

mitmproxy hands every hook of every flow to every addon in its chain: for each addon a coroutine and a
context manager, then a second pass over all of them for the ``update`` hook, whether the addon handles
the hook or not. On a sidecar's hot path that dispatch cost as much as tether's own decisions. Run as one
entry, tether's addons pay it once, and each still reads alone (docs/contract.md section 12).

What mitmproxy guarantees its addons holds here too: they run in order; an exception in one is logged and
the next still runs; an awaitable one returns (an approval hold) is awaited before the next one runs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import mitmproxy.proxy.layers  # noqa: F401  (registers the protocol hooks in hooks.all_hooks)
from mitmproxy import hooks

log = logging.getLogger("tether.sidecar")

HOOKS = ("http_connect", "tls_clienthello", "requestheaders", "request", "responseheaders", "response", "error",
         "tcp_start", "udp_start", "websocket_message", "websocket_end", "tether_list_piece")

Handler = Callable[..., Any]


def _relay(hook: str) -> Callable[[Pipeline, Any], Awaitable[None] | None]:
    def relay(self: Pipeline, flow: Any) -> Awaitable[None] | None:
        return self._run(self._handlers[hook], flow)

    relay.__name__ = relay.__qualname__ = hook
    return relay


class Pipeline:
    def __init__(self, addons: Sequence[Any]) -> None:
        self.stages = tuple(addons)
        unknown = [f"{type(a).__name__}.{name}" for a in self.stages for name in dir(a)
                   if not name.startswith("_") and name not in HOOKS and name in hooks.all_hooks]
        if unknown:  # a hook this class does not relay would silently never run
            raise TypeError(f"Pipeline does not relay {', '.join(unknown)}")
        self._handlers: dict[str, tuple[Handler, ...]] = {
            hook: tuple(getattr(a, hook) for a in self.stages if callable(getattr(a, hook, None))) for hook in HOOKS
        }

    # mitmproxy looks hooks up by name on the addon: one relay per hook tether's addons use.
    http_connect = _relay("http_connect")
    tls_clienthello = _relay("tls_clienthello")
    requestheaders = _relay("requestheaders")
    request = _relay("request")
    responseheaders = _relay("responseheaders")
    response = _relay("response")
    error = _relay("error")
    tcp_start = _relay("tcp_start")
    udp_start = _relay("udp_start")
    websocket_message = _relay("websocket_message")
    websocket_end = _relay("websocket_end")
    tether_list_piece = _relay("tether_list_piece")  # proxy.streamlayer's own hook

    @staticmethod
    def _run(handlers: tuple[Handler, ...], flow: Any) -> Awaitable[None] | None:
        """Synchronous while every stage is; from the first awaitable on, the rest runs in a coroutine."""
        for index, handler in enumerate(handlers):
            try:
                result = handler(flow)
            except Exception:
                log.exception("addon %s failed on %s", _name(handler), flow)
                continue
            if result is not None and inspect.isawaitable(result):
                return Pipeline._finish(result, handlers[index + 1:], flow)
        return None

    @staticmethod
    async def _finish(pending: Awaitable[Any], rest: tuple[Handler, ...], flow: Any) -> None:
        try:
            await pending
        except Exception:
            log.exception("addon hook failed on %s", flow)
        for handler in rest:
            try:
                result = handler(flow)
                if result is not None and inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("addon %s failed on %s", _name(handler), flow)


def _name(handler: Handler) -> str:
    return getattr(handler, "__qualname__", repr(handler))
