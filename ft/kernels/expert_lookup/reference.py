"""Expert lookup with use bookkeeping and landing-slot claims: the torch reference."""

from __future__ import annotations

import torch


def expert_lookup_ref(ids: torch.Tensor, slot_table: torch.Tensor, book, layer: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and landing slots of one MoE layer's routed experts, with the book's updates.

    Args:
        ids: [T, k] expert ids (distinct within a row); slot_table: [E] integer slot of each
            expert of this layer (-1: no slot); book: an `ExpertBook`; layer: its row.
    Returns: (slots [T, k] int32, dst [T, k] int32): the slot of each pair's expert (-1: a miss,
        read from the host store), and for the first miss of each expert this step (rows in
        order) the landing slot its bytes are to be written to (the next free one of
        book.landing[layer], -1 when none is left); -1 for every other pair.
    Book updates, real rows only (t < step[1]): last_use[layer, e] = step; counters[layer] +=
        (hits, misses); per claimed miss: claim[layer, e] = step,
        landing_used[layer] += 1, landed[layer, i] = e for the landing slot i it got.
    """
    step, real = int(book.step[0]), int(book.step[1])
    slots = slot_table[ids].to(torch.int32)
    dst = torch.full_like(slots, -1)
    cap = book.landing.shape[1]
    for t in range(min(real, ids.shape[0])):
        row = ids[t]
        book.last_use[layer, row] = step
        miss = slots[t] < 0
        book.counters[layer, 0] += int((~miss).sum())
        book.counters[layer, 1] += int(miss.sum())
        for j in miss.nonzero().flatten().tolist():
            e = int(row[j])
            if int(book.claim[layer, e]) >= step:  # an earlier row claimed it this step
                continue
            book.claim[layer, e] = step
            i = int(book.landing_used[layer])
            book.landing_used[layer] += 1
            if i < cap and int(book.landing[layer, i]) >= 0:
                dst[t, j] = book.landing[layer, i]
                book.landed[layer, i] = e
    return slots, dst


def commit_landed_ref(slot_table: torch.Tensor, book) -> None:
    """Map the experts a step landed, on the device, right after the step (before the host hears of it).

    Args:
        slot_table: [L, E] integer slot of each expert (-1: none), written in place; book: the
            `ExpertBook` the step's lookups filled.
    Effect: slot_table[l, landed[l, i]] = landing[l, i] for every landing slot i the step claimed
        (i < min(landing_used[l], R)) that was reserved (landing[l, i] >= 0): the next step hits them.
    """
    r = book.landing.shape[1]
    claimed = torch.arange(r, device=book.landing.device)[None, :] < book.landing_used[:, None]
    layer, i = torch.nonzero(claimed & (book.landing >= 0), as_tuple=True)
    slot_table[layer, book.landed[layer, i].long()] = book.landing[layer, i].to(slot_table.dtype)
