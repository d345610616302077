"""A step's results to the host: the sampled token ids, and the logprob tensors that travel with
them, in one small device-to-host copy through pinned memory, then one event wait.

The model runner's only sync point: every step ends in `wait` (directly, or inside `to_host`), so
the next step may rewrite the host staging that this step's non-blocking copies read.
"""

from __future__ import annotations

import torch


class ResultCopy:
    """Pinned host buffers for `rows` results (grown on demand) and the CUDA event a step waits on;
    on the CPU (no event) the tensors are read directly."""

    def __init__(self, rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._sampled = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)  # host side of token ids
        self._packed = torch.zeros(rows, dtype=torch.float64, pin_memory=pin)  # ids + logprobs
        self._event = torch.cuda.Event() if pin else None
        # overlapped decode: two pinned id buffers and their events, used in turn (`start`)
        self._pair = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._pair_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0

    def start(self, ids: torch.Tensor) -> tuple:
        """Queue the copy of [B] int64 ids to the host without waiting; `take` waits and reads them.
        At most two started copies may be untaken at a time (their buffers alternate)."""
        if self._pair_events is None:
            return (ids, None)
        i, self._turn = self._turn, 1 - self._turn
        b = ids.shape[0]
        if b > self._pair[i].numel():
            self._pair[i] = torch.zeros(b, dtype=torch.int64, pin_memory=True)
        out = self._pair[i][:b]
        out.copy_(ids, non_blocking=True)
        self._pair_events[i].record()
        return (out, self._pair_events[i])

    def take(self, handle: tuple) -> list[int]:
        """The ids of a `start`ed copy, once it has landed (waits for it and for all before it)."""
        out, event = handle
        if event is not None:
            event.synchronize()
        return out.tolist()

    def to_host(self, ids: torch.Tensor | None, extras: list[torch.Tensor] = ()) -> tuple[list[int], list[list[float]]]:
        """[B] int64 on the device -> Python ints, and each extra tensor (logprobs, their ids) -> a
        flat list of floats: one small copy (pinned, then an event wait). With extras, everything is
        packed into one float64 tensor first (token ids < 2**53 and float32 values are exact)."""
        if not extras:
            if ids is None:
                self.wait()
                return [], []
            if self._event is None:
                return ids.tolist(), []
            b = ids.shape[0]
            if b > self._sampled.numel():  # NOTE: grows only for a batch over the constructor's size
                self._sampled = torch.zeros(b, dtype=torch.int64, pin_memory=True)
            out = self._sampled[:b]
            out.copy_(ids, non_blocking=True)
            self.wait()
            return out.tolist(), []
        parts = ([] if ids is None else [ids]) + list(extras)
        sizes = [t.numel() for t in parts]
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts])
        if self._event is None:
            values = flat.tolist()
        else:
            if flat.numel() > self._packed.numel():
                self._packed = torch.zeros(max(flat.numel(), 2 * self._packed.numel()), dtype=torch.float64,
                                           pin_memory=True)
            out = self._packed[: flat.numel()]
            out.copy_(flat, non_blocking=True)
            self.wait()
            values = out.tolist()
        lists, at = [], 0
        for n in sizes:
            lists.append(values[at : at + n])
            at += n
        if ids is None:
            return [], lists
        return [int(t) for t in lists[0]], lists[1:]

    def wait(self) -> None:
        """Wait for this step's device work. NOTE: every step ends here, so the next step may
        rewrite the host staging that this step's non-blocking copies read."""
        if self._event is not None:
            self._event.record()
            self._event.synchronize()
