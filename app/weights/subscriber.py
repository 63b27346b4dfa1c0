"""A generator's side of the weight plane behind one call: ``Subscriber.swap_into(model)``.

Built once per generator from its model: it lays the model's parameters out as one flat
buffer per dtype (``flatten_parameters_``: a swap is then one copy per dtype), sets its
linear layers to ``--gen-precision`` (``llamarl.app.sampling.precision.quantize_``, refused
here when this device cannot run it), and joins the plane (``llamarl.app.weights.joining``:
the current epoch, and the next one after a break or a restart of this replica). From
``start()`` on, a background thread receives every version into staging and, with the
digest on, checks it against the trainer ranks' signed records as it lands
(``llamarl.app.weights.digest.DigestCheck``; a refused version is never staged). Between
decode batches ``swap_into(model)`` copies the newest staged version into the model and,
below fp32, rebuilds its quantized kernels from the new weights (recorded as the
``quantize`` busy interval and ``weights/quantize_s`` at the version's step).

``events()`` hands over what the metrics record of it since the last call: a
``weight_sync`` event per receive (``generator/<replica>``) and the quantization times;
``digest_metrics()`` the refusals so far, by reason (``security/weight_digest/<reason>``).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from llamarl.app import names
from llamarl.app.control.runtime import Runtime
from llamarl.app.metrics import events as metrics
from llamarl.app.sampling import quantize_
from llamarl.app.weights.digest import DigestCheck
from llamarl.app.weights.group import WeightSyncError
from llamarl.app.weights.joining import ElasticReceiver
from llamarl.app.weights.layout import flatten_parameters_

log = logging.getLogger("llamarl")

__all__ = ["Subscriber"]


class Subscriber:
    """Generator ``rt.replica``'s weights, kept current: ``start()`` once, ``swap_into(model)``
    between decode batches, ``close()`` at the end.

    ``precision``: the generator's ``--gen-precision``. ``timeout_s``: the weight group's
    timeout (``--weight-sync-timeout-s``), also how long a received version waits for its
    digest records. ``digest``: check every version's signed digest (``--weight-digest``).
    ``timeline``: the generator's busy and idle intervals, where quantizing is recorded.
    """

    def __init__(self, rt: Runtime, model: nn.Module, *, precision: str, timeout_s: float, digest: bool,
                 timeline: metrics.Timeline) -> None:
        self.rt, self.model, self.timeline = rt, model, timeline
        self.member = names.member("generator", rt.replica)
        flatten_parameters_(model)
        # The same parameters, so the receiver writes into them as at fp32.
        self.quantized = quantize_(model, precision)
        # Runs on the receiver's thread: a store connection of its own.
        self.check = (DigestCheck(rt.signed.clone(), rt.replica, wait_s=timeout_s, should_stop=rt.should_stop)
                      if digest else None)
        self.receiver = ElasticReceiver(rt.signed, rt.replica, list(model.named_parameters()),
                                        timeout_s=timeout_s, verify=self.check)
        self._quantize_events: list[dict[str, Any]] = []

    def start(self) -> None:
        """Receive in the background from now on, until the run stops or ``close``."""
        self.receiver.start_background(should_stop=self.rt.should_stop)

    def waiting(self) -> bool:
        """Whether a version newer than the model's is staged and ``swap_into`` would take it now."""
        return self.receiver.waiting()

    def swap_into(self, model: nn.Module) -> int | None:
        """Copy the newest complete version into ``model`` (the one this subscriber was built
        for) and refresh its quantized kernels; the version now in it, or ``None`` when none
        newer is waiting (or a receive is writing staging: the next call takes it)."""
        if model is not self.model:
            raise ValueError("Subscriber.swap_into: this subscriber receives into the model it was built for, "
                             "not another one")
        new = self.receiver.swap_if_newer()
        if new is not None and self.quantized is not None:
            with self.timeline.busy("quantize"):
                seconds = self.quantized.refresh()
            self._quantize_events += metrics.scalars({names.WEIGHTS_QUANTIZE_S: seconds}, role="generator",
                                                     replica=self.rt.replica, step=new)
        return new

    def latest_version(self) -> int | None:
        """The newest version received (swapped in or not), ``None`` before the first."""
        return self.receiver.latest_version()

    def events(self) -> list[dict[str, Any]]:
        """The ``weight_sync`` events of the receives and the quantization times since the last call."""
        out = [metrics.weight_sync(s.version, self.member, s.bytes, s.seconds) for s in self.receiver.pop_stats()]
        out, self._quantize_events = out + self._quantize_events, []
        return out

    def digest_metrics(self) -> dict[str, float]:
        """Versions refused so far, by reason (empty with the digest off)."""
        return self.check.metrics() if self.check is not None else {}

    def new_refusals(self) -> dict[str, float]:
        """``digest_metrics()`` when they changed since the last call, else an empty dict."""
        return self.check.new_counts() if self.check is not None else {}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the receiver thread (it must leave gloo before the interpreter exits, or the
        process aborts; it can only be stuck in a sync when the run is failing anyway)."""
        try:
            self.receiver.stop_background(timeout_s=timeout_s)
        except WeightSyncError as e:
            log.warning("%s", e)
