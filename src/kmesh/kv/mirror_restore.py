"""A mirror's rows restored from its master (kv/master_mirror.py): the sibling's region KV.

Every region token reads one master slot, its key turned from the slot's position to the token's
(RoPE composes: kmesh/compute/rope.py). A mirror made by `Mirror.of` reads each of its segments
from consecutive master slots at one turn, so the tokens fall into runs: consecutive tokens that
read consecutive slots at the same turn. A run is read a block at a time (a block's part, then
whole blocks at once: strided views, no gather), its values copied and its keys turned straight
into the destination with one cos/sin row per layer (its layer's RoPE table); then the diff's rows
replace theirs. Any mirror restores, whatever its runs (one token each at worst).

`restore_into` writes the rows into the caller's tensors (a region's rows, say): nothing of the
region's size is allocated. `restore` allocates them. Both give the same bits as gathering every
key and turning it by its own angle with `apply_rope`: a run's cos/sin row is the one each of its
tokens would get, and `turn_into` rounds as apply_rope does.

Invariants: k, v are [L, T, H, D] in the master's dtype, T = the mirror's tokens; every row is
written (a token's master row, or its diff row); k, v do not overlap the master's blocks.
"""

from collections.abc import Iterator

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.rope import layer_frequencies, rope_cos_sin, turn_into
from kmesh.kv.master_mirror import Master, Mirror, check_fits


def restore(
    master: Master, mirror: Mirror, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sibling's region KV (k, v), each [L, T, H, D], in sibling token order."""
    blocks = master.blocks
    shape = (blocks.shape[2], mirror.positions.numel(), *blocks.shape[4:])
    k = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
    v = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
    restore_into(master, mirror, config, k, v)
    return k, v


def restore_into(
    master: Master, mirror: Mirror, config: ModelConfig, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write the sibling's region KV into k, v [L, T, H, D] (views allowed)."""
    check_fits(master, mirror, config)
    bs = master.block_size
    keys, values = master.blocks[:, 0], master.blocks[:, 1]  # [B, L, bs, H, D]
    slots = mirror.block_table[mirror.token_slots // bs] * bs + mirror.token_slots % bs
    turn = mirror.positions - (master.block_positions[slots // bs] + slots % bs)
    inv_freq = layer_frequencies(config).to(k.device)  # [L, D/2]: each layer's own table
    for token, slot, count, angle in _runs(slots, turn):
        cos, sin = (x[:, 0] for x in rope_cos_sin(torch.tensor([angle], device=k.device), inv_freq))
        for block, within, whole, rows in _pieces(slot, count, bs):
            at = slice(token + rows.start, token + rows.stop)
            if whole:  # whole blocks: [L, whole, bs, H, D] views on both sides
                src_k = keys[block : block + whole].transpose(0, 1)
                src_v = values[block : block + whole].transpose(0, 1)
                dst_k, dst_v = (
                    k[:, at].unflatten(1, (whole, bs)),
                    v[:, at].unflatten(1, (whole, bs)),
                )
            else:  # one block's part
                src_k = keys[block, :, within : within + len(rows)]
                src_v = values[block, :, within : within + len(rows)]
                dst_k, dst_v = k[:, at], v[:, at]
            per_layer = (len(cos), *[1] * (src_k.dim() - 2), cos.shape[-1])
            turn_into(src_k, cos.view(per_layer), sin.view(per_layer), dst_k)
            dst_v.copy_(src_v)
    if mirror.diff_index.numel():
        diff_of = torch.full_like(mirror.block_table, -1, dtype=torch.int64)
        diff_of[mirror.diff_index] = torch.arange(mirror.diff_index.numel(), device=k.device)
        index = diff_of[mirror.token_slots // bs]
        diffed = (index >= 0).nonzero().flatten()
        picked, slot_in_block = index[diffed], mirror.token_slots[diffed] % bs
        diff = mirror.diff_blocks.permute(1, 2, 0, 3, 4, 5)  # [2, L, d, bs, H, D]
        k[:, diffed] = diff[0][:, picked, slot_in_block]
        v[:, diffed] = diff[1][:, picked, slot_in_block]


def _runs(slots: torch.Tensor, turn: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first token, first master slot, tokens, turn) of each run of consecutive tokens reading
    consecutive slots at one turn."""
    n = slots.numel()
    if n == 0:
        return []
    breaks = (slots[1:] != slots[:-1] + 1) | (turn[1:] != turn[:-1])
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten().cpu() + 1))
    ends = torch.cat((starts[1:], torch.tensor([n])))
    firsts, turns = slots.cpu()[starts].tolist(), turn.cpu()[starts].tolist()
    return list(zip(starts.tolist(), firsts, (ends - starts).tolist(), turns, strict=True))


def _pieces(slot: int, count: int, bs: int) -> Iterator[tuple[int, int, int, range]]:
    """The master slots [slot, slot + count) a block at a time: (block, first slot in it, whole
    blocks from it (0: a part of it), the run's rows it holds)."""
    done = 0
    while done < count:
        block, within = divmod(slot + done, bs)
        if within == 0 and count - done >= bs:
            whole = (count - done) // bs
            yield block, 0, whole, range(done, done + whole * bs)
            done += whole * bs
        else:
            take = min(bs - within, count - done)
            yield block, within, 0, range(done, done + take)
            done += take
