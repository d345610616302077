"""Tensors whose leading dimension grows or shrinks at its tail, keeping the rows below.

Every pool is row-major over its unit (page, slot), so a resize only touches the tail. On the
CPU (and as the fallback elsewhere) the tensor's storage is resized in place; the CUDA path maps
and unmaps physical chunks of a reserved address range instead (no copy, stable addresses).
"""

from __future__ import annotations

import torch


def resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A view of `rows` rows over t's storage, resized; rows below min(rows, len(t)) keep their
    data, new rows are uninitialised. `t` and every older view of it are invalid afterwards."""
    if t.storage_offset() != 0 or not t.is_contiguous():
        raise ValueError("resize_rows needs a contiguous tensor that owns its storage from offset 0")
    row_shape = tuple(t.shape[1:])
    row_bytes = t.element_size()
    for d in row_shape:
        row_bytes *= d
    storage = t.untyped_storage()
    storage.resize_(rows * row_bytes)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (rows, *row_shape))


class PoolInconsistent(RuntimeError):
    """A multi-tensor resize failed and so did putting it back: the pool's tensors disagree on
    their row count. The pool narrows itself to the rows all of them have (it stays usable) and
    the engine reports a degraded state."""


def resize_together(storage, tensors: list[torch.Tensor], rows: int, label: str) -> None:
    """Resize every tensor of one pool to `rows` rows, all or nothing, in place in `tensors`.

    On a failure the tensors already resized go back to their old row count (their kept rows keep
    their data; rows past the smaller size are uninitialised, which callers allow for by freeing
    them first) and the error is re-raised. If going back fails too, PoolInconsistent is raised
    with both errors chained and `tensors` hold what each really has.
    """
    old = tensors[0].shape[0]
    done = 0
    try:
        for i, t in enumerate(tensors):
            tensors[i] = storage.resize(t, rows, f"{label}[{i}]")
            done = i + 1
    except BaseException as err:
        for i in reversed(range(done)):
            try:
                tensors[i] = storage.resize(tensors[i], old, f"undo {label}[{i}]")
            except BaseException as undo_err:
                raise PoolInconsistent(
                    f"{label}: resizing to {rows} rows failed ({err}) and restoring {old} rows failed "
                    f"({undo_err})") from undo_err
        raise


def narrow_to_common(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the rows every tensor has (after a PoolInconsistent)."""
    rows = min(t.shape[0] for t in tensors)
    return [t[:rows] for t in tensors]


def follow_free_slots(free: list[int], old: int, new: int) -> list[int]:
    """A slot pool's free list (popped from its end) after its size went from `old` to `new`:
    slots past a smaller size dropped, a larger size's new slots handed out lowest first."""
    if new < old:
        return [s for s in free if s < new]
    return list(range(new - 1, old - 1, -1)) + free
