"""Expert lookup with use bookkeeping and landing-slot claims: the torch reference."""

from __future__ import annotations

import torch


def expert_lookup_ref(ids: torch.Tensor, slot_table: torch.Tensor, book, layer: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and landing slots of one MoE layer's routed experts, with the book's updates.

    Args:
        ids: [T, k] expert ids (distinct within a row); slot_table: [L, E] integer slot of each
            expert (-1: no slot), this layer's row read, entries of claimed victims cleared;
            book: an `ExpertBook`; layer: the MoE layer.
    Returns: (slots [T, k] int32, dst [T, k] int32): the slot of each pair's expert (-1: a miss,
        read from the host store), and for the first miss of each expert this step (rows in
        order) the landing slot its bytes are to be written to (the next claimable one of
        book.landing[layer], -1 when none is left or it is a hole); -1 for every other pair.
    Book updates, real rows only (t < step[1]): last_use[layer, e] = step; counters[layer] +=
        (hits, misses); per claimed miss: claim[layer, e] = step, landing_used[layer] += 1,
        landed[layer, i] = e for the landing slot i it got, and the slot's owner (if any) unmapped
        in slot_table. Claimable: the reserved slots whose owner no real row routed this step up
        to this layer (last_use[owner] < step, after this layer's stamps): a victim used this step
        stays, and one of this layer that a pair reads is never overwritten under it.
    """
    step, real = int(book.step[0]), int(book.step[1])
    slots = slot_table[layer][ids].to(torch.int32)
    dst = torch.full_like(slots, -1)
    rows = range(min(real, ids.shape[0]))
    for t in rows:
        book.last_use[layer, ids[t]] = step
    owner = book.owner[layer].tolist()
    last = book.last_use.view(-1)
    claimable = [i for i, o in enumerate(owner) if o < 0 or int(last[o]) < step]
    for t in rows:
        row = ids[t]
        miss = slots[t] < 0
        book.counters[layer, 0] += int((~miss).sum())
        book.counters[layer, 1] += int(miss.sum())
        for j in miss.nonzero().flatten().tolist():
            e = int(row[j])
            if int(book.claim[layer, e]) >= step:  # an earlier row claimed it this step
                continue
            book.claim[layer, e] = step
            c = int(book.landing_used[layer])
            book.landing_used[layer] += 1
            if c < len(claimable) and int(book.landing[layer, claimable[c]]) >= 0:
                i = claimable[c]
                dst[t, j] = book.landing[layer, i]
                book.landed[layer, i] = e
                if owner[i] >= 0:
                    slot_table.view(-1)[owner[i]] = -1
    return slots, dst


def commit_landed_ref(slot_table: torch.Tensor, book) -> None:
    """Map the experts a step landed, on the device, right after the step (before the host hears of it).

    Args:
        slot_table: [L, E] integer slot of each expert (-1: none), written in place; book: the
            `ExpertBook` the step's lookups filled.
    Effect: slot_table[l, landed[l, i]] = landing[l, i] for every landing slot i a miss claimed this
        step (landed[l, i] >= 0) that was reserved (landing[l, i] >= 0): the next step hits them.
    """
    layer, i = torch.nonzero((book.landed >= 0) & (book.landing >= 0), as_tuple=True)
    slot_table[layer, book.landed[layer, i].long()] = book.landing[layer, i].to(slot_table.dtype)
